"""Kernels compiled from edited sources, for timing experiments (``scripts/probes/probe_*.py``).

Probe-only machinery, kept out of the runtime package: the backend's one public way to take
kernels from elsewhere is :meth:`lserve.attention.cupy_backend.CupyBackend.override_kernels`.
"""

from __future__ import annotations


def edited_source(family: str, edits: list[tuple[str, str]]) -> str:
    """``family``'s CUDA source with text ``edits`` applied (each ``(old, new)``).

    Raises
    ------
    ValueError
        If an ``old`` text does not occur exactly once (an edit must not apply silently elsewhere).
    """
    from lserve.kernels.loader import source_of

    src = source_of(family)
    for a, b in edits:
        if src.count(a) != 1:
            raise ValueError(f"edit of {family} does not match exactly once: {a[:60]!r}")
        src = src.replace(a, b)
    return src


def compile_for(be, family: str, src: str):
    """``src`` compiled as ``family`` for the backend ``be``'s variant (unquantized, its ``gq``)."""
    import cupy
    from lserve.kernels.loader import Variant, options_of

    return cupy.RawModule(code=src, options=options_of(Variant(family, be.dt_name, be.D, "none", be.gq)),
                          backend="nvrtc")


def use_edited(be, family: str, edits: list[tuple[str, str]]) -> None:
    """Point ``be`` at ``family`` compiled with ``edits``; ``be.clear_kernel_overrides()`` undoes it."""
    be.override_kernels(family, compile_for(be, family, edited_source(family, edits)))
