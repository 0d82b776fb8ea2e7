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


def _c_kind(decl: str) -> str:
    # A C parameter declaration -> how Python passes it (kernels/decode_args.py kinds).
    if "*" in decl:
        return "ptr"
    ctype = decl.split()[-2]
    return {"int": "i32", "i64": "i64", "float": "f32"}[ctype]


def _kernel_params(src: str, name: str) -> list[tuple[str, str]]:
    src = re.sub(r"//[^\n]*", "", src)  # comments hold parentheses and commas
    m = re.search(rf"\b{name}\s*\(([^)]*)\)\s*\{{", src)
    assert m, f"no definition of {name}"
    body = m.group(1)
    return [(d.split()[-1].lstrip("*"), _c_kind(d)) for d in (p.strip() for p in body.split(",")) if d]


def test_decode_signatures_match_the_python_argument_table():
    """Names, order and types of ls_decode / ls_decode_tc equal the table the launcher packs from."""
    from lserve.kernels.decode_args import DECODE_KERNELS, DECODE_PARAMS

    for impl, (fname, kernel) in DECODE_KERNELS.items():
        got = _kernel_params((KERNEL_DIR / fname).read_text(), kernel)
        assert got == list(DECODE_PARAMS[impl]), f"{fname}:{kernel} differs from DECODE_PARAMS[{impl!r}]"


def test_decode_args_rejects_missing_or_unknown_names():
    import pytest
    from lserve.kernels.decode_args import DECODE_PARAMS, decode_args

    values = {n: 0 for n, kind in DECODE_PARAMS["cuda"] if kind != "ptr"}
    with pytest.raises(TypeError, match="missing"):
        decode_args("cuda", **values)


def test_meta_layout_is_defined_once():
    """decode_meta.cuh is the only file defining META rows; every kernel reading META includes it,
    and the Python META_FIELDS (the order the planner stacks rows in) follow its defines and MetaRow."""
    import pytest
    from lserve.kernels.decode_args import META_FIELDS

    pytest.importorskip("torch")
    from lserve.attention.cupy_plan import META_FIELDS as plan_fields

    header = (KERNEL_DIR / "decode_meta.cuh").read_text()
    rows = dict((n.lower(), int(i)) for n, i in re.findall(r"^#define META_(\w+)\s+(\d+)", header, re.M))
    assert [rows[f] for f in META_FIELDS] == list(range(len(META_FIELDS)))
    assert plan_fields == META_FIELDS
    loads = re.findall(r"m\.\w+ = meta\[META_(\w+) \* nb \+ b\]", header)
    assert [x.lower() for x in loads] == list(META_FIELDS), "load_meta reads the rows out of order"
    for f in sorted(KERNEL_DIR.glob("*.c*")):
        if f.name == "decode_meta.cuh":
            continue
        src = f.read_text()
        assert not re.search(r"#define\s+META_", src), f"{f.name} redefines a META row"
        if re.search(r"\bMETA_\w+", src):
            assert '#include "decode_meta.cuh"' in src, f"{f.name} reads META without decode_meta.cuh"


def test_sm90a_cache_key_covers_the_included_headers(tmp_path, monkeypatch):
    """The sm_90a cubin cache is named by build_key: editing a header the kernel includes, directly
    or through another header, must give a new name (a stale cubin would run the old header);
    editing a header it does not include, or nothing, keeps the name."""
    import shutil

    from lserve.kernels import loader

    for f in list(KERNEL_DIR.glob("*.cu")) + list(KERNEL_DIR.glob("*.cuh")):
        shutil.copy(f, tmp_path / f.name)
    monkeypatch.setattr(loader, "KERNEL_DIR", tmp_path)
    var = loader.Variant("bsp_prefill_ws4", "bf16", 128, tuning=("LS_BSP_STAGES=2",))
    names = {p.name for p in loader.included_headers(var.family)}
    assert names == {"common.cuh", "mma.cuh", "wgmma.cuh", "sm90_pipe.cuh", "bsp_tile.cuh"}
    key = loader.build_key(var)
    assert loader.build_key(var) == key
    assert loader.build_key(loader.Variant("bsp_prefill_ws4", "bf16", 128, tuning=("LS_BSP_STAGES=3",))) != key
    seen = {key}
    for header in ("sm90_pipe.cuh", "mma.cuh"):  # included directly; only through wgmma.cuh
        with open(tmp_path / header, "a") as f:
            f.write("\n// edited\n")
        assert loader.build_key(var) not in seen, header
        seen.add(loader.build_key(var))
    with open(tmp_path / "decode_meta.cuh", "a") as f:  # not included by this family
        f.write("\n// edited\n")
    assert loader.build_key(var) in seen


def test_cupy_cache_key_covers_the_included_headers(tmp_path, monkeypatch):
    """Outside sm_90a CuPy caches binaries by source text and options: the source it is given names
    the build key, so an edited header (directly or through another) changes the text it hashes."""
    import shutil

    from lserve.kernels import loader

    for f in list(KERNEL_DIR.glob("*.cu")) + list(KERNEL_DIR.glob("*.cuh")):
        shutil.copy(f, tmp_path / f.name)
    monkeypatch.setattr(loader, "KERNEL_DIR", tmp_path)
    var = loader.Variant("decode", "bf16", 128)
    before = loader.nvrtc_source(var)
    assert before.startswith(loader.source_of("decode")) and loader.build_key(var) in before
    assert loader.nvrtc_source(var) == before
    with open(tmp_path / "common.cuh", "a") as f:
        f.write("\n// edited\n")
    assert loader.nvrtc_source(var) != before


def test_shared_memory_opt_in_counts_the_static_part():
    # The estimate's mass kernel holds 132 B of static shared memory: at a 786k-token row its
    # 48 KiB of block sums failed to launch until the opt-in counted both parts (H100, 1M context).
    from types import SimpleNamespace

    from lserve.kernels.loader import opt_in_shared

    kern = SimpleNamespace(shared_size_bytes=132, max_dynamic_shared_size_bytes=48 * 1024 - 132)
    opt_in_shared(kern, 48 * 1024)
    assert kern.max_dynamic_shared_size_bytes == 48 * 1024
    small = SimpleNamespace(shared_size_bytes=132, max_dynamic_shared_size_bytes=0)
    opt_in_shared(small, 1024)  # under 48 KiB in all: no opt-in, the default limit serves
    assert small.max_dynamic_shared_size_bytes == 0
