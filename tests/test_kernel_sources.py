"""The kernel loader's family table matches the CUDA sources (checked without a GPU): every
``extern "C" __global__`` entry point is listed under its file's family and every listed name
exists, so a kernel added to a .cu file cannot be unreachable from the backend."""

from __future__ import annotations

import re

from lserve.kernels.loader import FAMILIES, KERNEL_DIR


def test_family_table_matches_sources():
    for family, (fname, names) in FAMILIES.items():
        src = (KERNEL_DIR / fname).read_text()
        entry = set(re.findall(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+(\w+)\s*\(', src))
        assert entry == set(names), f"{family}: {fname} defines {sorted(entry)}, the loader lists {sorted(names)}"
