"""From a timing sweep to a profiled threshold: the context from which a faster path keeps paying.

``lserve bench profile-threshold`` (decode page selection) and ``profile-prefill-threshold``
(block-sparse prefill) time both paths over a range of contexts on this device; here the sweep
becomes the entry :func:`lserve.sparsity.threshold.save_profile` stores for engines to read.
"""

from __future__ import annotations


def first_paying(rows: list[dict], base: str, candidate: str, margin: float = 0.0) -> tuple[int | None, int]:
    """(threshold, context to switch on from) of a sweep: the smallest measured context from which
    ``candidate`` is faster than ``base`` by more than ``margin`` (a share of ``base``: a gain
    inside the timing noise does not count) at every larger measured context too (None: not at
    the largest), and that context, or twice the largest measured one where it never paid (off as
    far as measured)."""
    threshold = None
    for r in sorted(rows, key=lambda r: -r["context"]):
        if r[candidate] >= (1.0 - margin) * r[base]:
            break
        threshold = r["context"]
    return threshold, threshold if threshold is not None else 2 * max(r["context"] for r in rows)


def choose_ratio(rows: list[dict], budget: int) -> tuple[float, int | None]:
    """The ratio from a sweep of ``{"context", "dense_ms", "dynamic_ms"}`` rows.

    The threshold is the smallest measured context from which dynamic selection is faster at
    every larger measured context too. If it never pays within the sweep, the ratio is twice
    the largest measured one (selection stays off as far as we know) and the threshold None.
    """
    threshold, switch_on = first_paying(rows, "dense_ms", "dynamic_ms")
    if threshold is None:
        return switch_on / budget, None
    return threshold / budget, threshold
