"""Test helper: make an engine's prefill chunks end where another run's did.

Outputs with INT8/INT4 or 16-bit caches depend on where prefill chunks end, so a run with the
prefix cache (which resumes after the cached pages) is compared with an uncached run whose
chunks stop at the same places.
"""

from __future__ import annotations


def chunks_end_at(engine, ends: list[int]) -> None:
    """Make ``engine``'s prefill chunks stop at each of ``ends`` (token positions)."""
    budget = engine.scheduler.budget
    plain = budget.tokens_within

    def capped(room: float, start: int, remaining: int, sparse: bool = False) -> int:
        nxt = [e for e in ends if e > start]
        n = plain(room, start, remaining, sparse)
        return min(n, min(nxt) - start) if nxt else n

    budget.tokens_within = capped
