"""Launch-shape knobs of the CUDA backend that benchmarks and probes vary (validated once)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CupyTuning:
    """How :class:`~lserve.attention.cupy_backend.CupyBackend` shapes its decode-step launches.

    The defaults are what serving uses; tools change them with ``CupyBackend.tune(...)``, which
    builds a new validated object (no half-set state).

    Parameters
    ----------
    target_ctas : int or None
        Most decode units per launch (split-K granularity); None: one wave of resident CTAs.
    min_chunk : int
        Fewest table entries per decode unit (2: fewer, longer units and splits).
    score_ppb : int or None
        Physical pages per page-score CTA; None: sized for one wave of ~3 CTAs per SM.

    Raises
    ------
    ValueError
        For a value below 1 (or a non-integer).
    """

    target_ctas: int | None = None
    min_chunk: int = 2
    score_ppb: int | None = None

    def __post_init__(self) -> None:
        for name in ("target_ctas", "min_chunk", "score_ppb"):
            v = getattr(self, name)
            if v is None and name != "min_chunk":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"CupyTuning.{name} must be an integer >= 1{' or None' if name != 'min_chunk' else ''}, "
                                 f"got {v!r}")
