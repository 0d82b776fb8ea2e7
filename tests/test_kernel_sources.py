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


def test_pdl_argument_buffer_matches_the_c_layout():
    """The PDL launcher packs kernel arguments into one buffer: every value must sit at its C
    alignment, read back unchanged (a wrong offset would hand a kernel garbage pointers)."""
    import ctypes

    import numpy as np
    from lserve.kernels.pdl import _Layout

    args = (np.uint64(2**63 + 12345), np.int32(-7), np.uint64(42), np.float32(0.25), np.int32(3),
            np.int64(-(2**40)), np.float32(-1.5), np.int32(9))
    lay = _Layout([a.dtype for a in args])
    data = bytearray(lay.size)
    lay.packer.pack_into(data, 0, *args)
    base = ctypes.addressof((ctypes.c_char * lay.size).from_buffer(data))
    ctype = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int64): ctypes.c_int64,
             np.dtype(np.int32): ctypes.c_int32, np.dtype(np.float32): ctypes.c_float}
    for a, off in zip(args, lay.offsets.tolist()):
        ct = ctype[a.dtype]
        assert off % ctypes.alignment(ct) == 0
        assert ct.from_address(base + off).value == a.item()
    assert lay.offsets.tolist() == [0, 8, 16, 24, 28, 32, 40, 44]
