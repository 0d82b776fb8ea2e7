"""KV bytes a decode step reads, as a fraction of what dense attention reads: the one rule.

Dense attention reads, for every layer and KV head, every cached token of the sequence. A
decode step of LServe reads, per layer:

* streaming heads: the tokens of the ring pages that hold data (sink pages + the local ring,
  whole pages as the decode tables list them);
* dense heads of a layer that selects (dynamic selection on for this sequence and step, and
  the layer in ``select_layers``): the K - 1 pages kept by the last selector run plus every page
  from the one that was last at that run to the current last page, which may be partly filled
  (both backends read exactly these: the stored selection plus the pages appended since);
* dense heads of any other layer: every token.

Every head-token of both pools has the same storage (dtype and ``kv_quant`` are per cache), so
the fraction of head-tokens is the fraction of KV bytes. Key statistics read by the selector
are not counted (1/N_L of the keys, on selecting steps only). In ``select_mode="query"`` the
query heads of a group choose separately; a KV head's reads are then counted as the union
bound ``min(all, G x (K - 1) + recent)``.

:class:`KVReadMeter` accumulates the figure per sequence and in total; the attention backends'
common base feeds it from each step's plan, so both backends report the same figure.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def ring_tokens(page_in_slot: Sequence[int], length: int, page_size: int) -> int:
    """Tokens a streaming head reads: those of the ring pages holding data.

    Parameters
    ----------
    page_in_slot : sequence of int
        Logical page held by each ring slot (-1: none), as
        :meth:`lserve.cache.kv_cache.StreamRing.page_in_slot` gives it at ``length``.
    """
    return sum(min(page_size, length - i * page_size) for i in page_in_slot if 0 <= i and i * page_size < length)


def selected_tokens(length: int, page_size: int, budget_pages: int, pages_at_select: int, group: int = 1) -> int:
    """Tokens a selecting dense KV head reads at a decode step.

    Parameters
    ----------
    length : int
        Tokens in the cache (this step's included).
    budget_pages : int
        K: physical pages kept by a selector run (the last page included).
    pages_at_select : int
        Pages the sequence had when the selector last ran (its then-last page is re-read with
        every page appended since).
    group : int
        Query heads choosing separately per KV head (``select_mode="query"``: the group size),
        1 in kv mode.
    """
    recent = length - (pages_at_select - 1) * page_size  # the then-last page through the end
    return min(length, group * (budget_pages - 1) * page_size + recent)


def step_read(n_dense: Sequence[int], num_kv_heads: int, length: int, stream_tokens: int,
              selected: Sequence[int | None] | None) -> tuple[int, int]:
    """Head-tokens read by one sequence's decode step, and those dense attention reads.

    Parameters
    ----------
    n_dense : sequence of int
        Dense KV heads per layer (the head layout); the others are streaming.
    num_kv_heads : int
    length : int
        Tokens in the cache.
    stream_tokens : int
        Tokens each streaming head reads (:func:`ring_tokens`).
    selected : sequence of (int or None), or None
        Per layer: tokens each dense head reads when the layer selects (:func:`selected_tokens`),
        None when its dense heads read every token; None alone: no layer selects.

    Returns
    -------
    (int, int)
        ``(read, dense)`` head-tokens; ``read / dense`` is the fraction of dense KV bytes.
    """
    dense_heads, all_heads = sum(n_dense), len(n_dense) * num_kv_heads
    # every dense head reads all tokens, every streaming head its ring; then the selecting layers'
    # savings (one pass over the layers only where some select: it runs per sequence and step)
    read = dense_heads * length + (all_heads - dense_heads) * min(stream_tokens, length)
    if selected is not None:
        for nd, sel in zip(n_dense, selected, strict=True):
            if sel is not None and sel < length:
                read -= nd * (length - sel)
    return read, all_heads * length


@dataclass
class KVReadTotals:
    """Decode KV reads summed over sequence-steps: ``read`` and ``dense`` head-tokens.

    ``fraction`` = read / dense: the share of dense attention's KV bytes actually read (steps
    weighted by their context, i.e. total bytes over total bytes).
    """

    steps: int = 0
    read: int = 0
    dense: int = 0

    @property
    def fraction(self) -> float | None:
        return self.read / self.dense if self.dense else None

    def add(self, read: int, dense: int) -> None:
        self.steps += 1
        self.read += read
        self.dense += dense


class KVReadMeter:
    """Running totals of :func:`step_read`, overall, of the latest step, and per sequence.

    A released sequence's totals stay available (:meth:`pop`) for the ``keep`` most recently
    released sequences, so a caller can read them after the request finished.
    """

    def __init__(self, keep: int = 4096) -> None:
        self.total = KVReadTotals()
        self.last_step = KVReadTotals()
        self._live: dict[int, KVReadTotals] = {}
        self._done: OrderedDict[int, KVReadTotals] = OrderedDict()
        self._keep = keep

    def begin_step(self) -> None:
        self.last_step = KVReadTotals()

    def add(self, seq_id: int, read: int, dense: int) -> None:
        """Count one decode step of sequence ``seq_id`` (a preempted sequence continues its totals)."""
        self.total.add(read, dense)
        self.last_step.add(read, dense)
        t = self._live.get(seq_id)
        if t is None:
            t = self._live[seq_id] = self._done.pop(seq_id, None) or KVReadTotals()
        t.add(read, dense)

    def release(self, seq_id: int) -> None:
        t = self._live.pop(seq_id, None)
        if t is not None:
            self._done[seq_id] = t
            while len(self._done) > self._keep:
                self._done.popitem(last=False)

    def of(self, seq_id: int) -> KVReadTotals | None:
        """Totals of a live or recently released sequence (None if it never decoded)."""
        return self._live.get(seq_id) or self._done.get(seq_id)

    def pop(self, seq_id: int) -> KVReadTotals | None:
        """:meth:`of`, forgetting a released sequence's entry."""
        return self._done.pop(seq_id, None) or self._live.get(seq_id)
