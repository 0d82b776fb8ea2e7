"""Where LServe keeps files of its own on this machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """LServe's cache folder (``$LSERVE_CACHE_DIR``, default ~/.cache/lserve): dequantized weights
    and this device's threshold profiles."""
    return Path(os.environ.get("LSERVE_CACHE_DIR", Path.home() / ".cache" / "lserve"))
