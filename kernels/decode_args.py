"""The decode kernels' launch signature, written once on the Python side.

``ls_decode`` (decode.cu) and ``ls_decode_tc`` (decode_tc.cu) take ~45 positional arguments; a
mismatch in order or type hands a kernel garbage without any error. The launcher builds its
arguments by name through :func:`decode_args`, and ``tests/test_kernel_sources.py`` parses both
kernels' parameter lists and checks them against :data:`DECODE_PARAMS`, so the CUDA side and this
table cannot drift apart unnoticed. The META row layout is read from ``decode_meta.cuh``
(:data:`META_FIELDS`), the one file every kernel includes.
"""

from __future__ import annotations

import re

from lserve.kernels.loader import KERNEL_DIR

# (name, kind): kind is how the value is passed: ptr (device pointer), i32, i64 or f32.
_HEAD = (("q", "ptr"), ("q_tok_stride", "i64"), ("out", "ptr"), ("out_tok_stride", "i64"),
         ("part_o", "ptr"), ("part_lse", "ptr"), ("units", "ptr"), ("chunk", "i32"), ("direct", "i32"),
         ("meta", "ptr"), ("nb", "i32"), ("pages", "ptr"), ("pages_stride", "i32"),
         ("ring_pages", "ptr"), ("ring_pos", "ptr"), ("ring_stride", "i32"),
         ("sel_idx", "ptr"), ("sel_mask", "ptr"), ("sel_cnt", "ptr"))
_TC_SEL_PAGE = (("sel_page", "ptr"),)  # tensor-core kernel only: physical pages of sel_idx
_MID = (("sel_slot_stride", "i32"), ("sel_head_stride", "i32"), ("cnt_slot_stride", "i32"),
        ("qmode", "i32"), ("selects", "i32"),
        ("dk", "ptr"), ("dv", "ptr"), ("dks", "ptr"), ("dvs", "ptr"), ("dkz", "ptr"), ("dvz", "ptr"),
        ("hd", "i32"),
        ("sk", "ptr"), ("sv", "ptr"), ("sks", "ptr"), ("svs", "ptr"), ("skz", "ptr"), ("svz", "ptr"),
        ("hs", "i32"),
        ("group", "i32"), ("nqs", "i32"), ("page_size", "i32"), ("sink", "i32"), ("local", "i32"),
        ("qscale", "f32"))
_TC_PAGE_SHIFT = (("page_shift", "i32"),)  # tensor-core kernel only: log2(page size) or -1
_TAIL = (("sel_ready", "i32"), ("tier", "ptr"))  # tier: TierLayer of the layer (LS_TIER builds), else 0

DECODE_PARAMS: dict[str, tuple[tuple[str, str], ...]] = {
    "cuda": _HEAD + _MID + _TAIL,
    "tc": _HEAD + _TC_SEL_PAGE + _MID + _TC_PAGE_SHIFT + _TAIL,
}
"""Parameter list per decode implementation (``CupyBackend.decode_impl``), in kernel order."""

DECODE_KERNELS = {"cuda": ("decode.cu", "ls_decode"), "tc": ("decode_tc.cu", "ls_decode_tc")}
"""Source file and entry point of each decode implementation."""


def decode_args(impl: str, **values) -> tuple:
    """The positional launch arguments of the ``impl`` decode kernel, from named values.

    Parameters
    ----------
    impl : {"cuda", "tc"}
        ``"tc"`` for ``ls_decode_tc``; anything else is the CUDA-core ``ls_decode``.
    **values
        One value per name of ``DECODE_PARAMS[impl]``: tensors for ``ptr`` parameters, numbers
        otherwise.

    Returns
    -------
    tuple
        numpy scalars in kernel order, as :func:`lserve.kernels.loader.launch` takes them.

    Raises
    ------
    TypeError
        When a name is missing or unknown (a launch with a shifted argument would not fail).
    """
    from lserve.kernels.loader import f32, i32, i64, ptr

    params = DECODE_PARAMS["tc" if impl == "tc" else "cuda"]
    names = [n for n, _ in params]
    if set(values) != set(names):
        missing, extra = sorted(set(names) - set(values)), sorted(set(values) - set(names))
        raise TypeError(f"decode_args({impl!r}): missing {missing}, unknown {extra}")
    conv = {"ptr": ptr, "i32": i32, "i64": i64, "f32": f32}
    return tuple(conv[kind](values[name]) for name, kind in params)


def _meta_fields() -> tuple[str, ...]:
    # decode_meta.cuh: "#define META_<NAME> <row>", rows 0..n-1; the Python name is the lower case.
    src = (KERNEL_DIR / "decode_meta.cuh").read_text()
    rows = {int(i): n.lower() for n, i in re.findall(r"^#define META_(\w+)\s+(\d+)", src, re.M)}
    if sorted(rows) != list(range(len(rows))):
        raise RuntimeError(f"decode_meta.cuh: META rows {sorted(rows)} are not 0..{len(rows) - 1}")
    return tuple(rows[i] for i in range(len(rows)))


META_FIELDS: tuple[str, ...] = _meta_fields()
"""Rows of the per-sequence META table (``meta[f * nb + b]``), read from ``decode_meta.cuh``."""
