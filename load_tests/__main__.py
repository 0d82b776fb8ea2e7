"""Entry point of ``python -m load_tests``."""

import sys

from load_tests.cli import main

sys.exit(main())
