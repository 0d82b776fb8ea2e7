"""``python -m lserve`` is the ``lserve`` command."""

import sys

from lserve.cli import main

sys.exit(main())
