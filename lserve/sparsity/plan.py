"""Per-step plan: host-side metadata shared by every attention backend.

The scheduler describes each sequence of a step with a :class:`SeqStep`; the
:class:`StepPlanner` turns the batch into a :class:`StepPlan`: where new tokens are written in
both pools, which pages each sequence reads, whether dynamic page selection is active for a
sequence and whether the selector runs this step or reuses its last choice (every C steps).
Backends turn this into their own tables (torch: index tensors; cupy: int32 device tables).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from lserve.cache.kv_cache import KVCache
from lserve.config import SparsityConfig


@dataclass
class SeqStep:
    """One sequence's share of a step, as the scheduler sees it.

    ``start`` tokens are already cached; ``num_new`` tokens are computed now (1 at decode).
    ``dense_pages`` covers ``start + num_new`` tokens; ``stream_pages`` is the fixed ring.
    """

    seq_id: int
    start: int
    num_new: int
    decode: bool
    dense_pages: list[int]
    stream_pages: list[int] = field(default_factory=list)
    token_budget: int | None = None  # per-request override of SparsityConfig.token_budget


@dataclass
class SeqPlan:
    """What a backend needs to attend for one sequence."""

    step: SeqStep
    t0: int  # slice of this sequence's tokens in the step's flat token axis
    t1: int
    length: int  # tokens in cache once this step is written
    n_pages: int  # dense pages holding those tokens
    device: torch.device  # where ``pages`` is built
    dynamic: bool  # decode with page selection active
    budget_pages: int  # K physical pages (when dynamic)
    select: bool  # run the selector now (else reuse the last selection)
    ring_pages: torch.Tensor  # long [R]: streaming pages to read (slots holding data)
    ring_first_pos: torch.Tensor  # long [R]: position of the first token of each read page

    @cached_property
    def pages(self) -> torch.Tensor:
        """long [n]: dense pages, logical order (built on first use: O(context) host work that
        the CUDA kernels' backend, which reads ``step.dense_pages``, never asks for)."""
        return torch.tensor(self.step.dense_pages[: self.n_pages], dtype=torch.long, device=self.device)


@dataclass
class StepPlan:
    """The batch: per-sequence plans and the token write locations of both pools.

    Decode tokens are written before attention (they attend to themselves through the cache);
    prefill tokens after it (a chunk attends to its own fresh K/V plus the cached past).
    """

    seqs: list[SeqPlan]
    num_tokens: int
    # Each: (token index [W], page id [W], offset [W]) long tensors.
    dense_write_decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    dense_write_prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    stream_write_decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    stream_write_prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    def to(self, device) -> StepPlan:
        """The same plan with every tensor on ``device`` (a host-built plan run eagerly)."""
        def mv(t):
            return t.to(device)

        seqs = [replace(s, device=torch.device(device), ring_pages=mv(s.ring_pages),
                        ring_first_pos=mv(s.ring_first_pos)) for s in self.seqs]
        return StepPlan(seqs, self.num_tokens, *(tuple(mv(t) for t in w) for w in (
            self.dense_write_decode, self.dense_write_prefill, self.stream_write_decode, self.stream_write_prefill)))


class StepPlanner:
    """Builds :class:`StepPlan` objects and remembers, per sequence, when it last selected."""

    def __init__(self, sparsity: SparsityConfig, cache: KVCache, device) -> None:
        self.sp = sparsity
        self.cache = cache
        self.device = device
        self._decode_steps: dict[int, int] = {}
        self._last_select: dict[int, int] = {}
        # dynamic_threshold -1 (auto): selection runs from ratio * budget tokens (set by the
        # engine from the device's profile; 0 = whenever the context exceeds the budget).
        self.threshold_ratio = 0.0

    def threshold(self, budget: int) -> int:
        """Context length from which dynamic selection runs for ``budget``."""
        if self.sp.dynamic_threshold >= 0:
            return self.sp.dynamic_threshold
        return math.ceil(self.threshold_ratio * budget)

    def release(self, seq_id: int) -> None:
        """Forget a finished, aborted or preempted sequence."""
        self._decode_steps.pop(seq_id, None)
        self._last_select.pop(seq_id, None)

    def plan(self, steps: list[SeqStep], host: bool = False) -> StepPlan:
        """The step's plan; ``host``: tensors on the CPU (CUDA-graph steps copy them in one go)."""
        dev = torch.device("cpu") if host else self.device
        N = self.cache.page_size
        ring = self.cache.ring
        seqs: list[SeqPlan] = []
        writes = {key: ([], [], []) for key in ("dd", "dp", "sd", "sp")}
        t = 0
        for s in steps:
            length = s.start + s.num_new
            if len(s.dense_pages) * N < length:
                raise ValueError(f"sequence {s.seq_id}: {len(s.dense_pages)} pages cannot hold {length} tokens")
            pos = range(s.start, length)
            key = "d" if s.decode else "p"
            tok, pg, off = writes["d" + key]
            tok.extend(range(t, t + s.num_new))
            pg.extend(s.dense_pages[p // N] for p in pos)
            off.extend(p % N for p in pos)
            if self.cache.has_streaming:
                # Only tokens still in the ring after this step are written (no slot written twice).
                last_page = (length - 1) // N
                tok, pg, off = writes["s" + key]
                for i, p in enumerate(pos):
                    page = p // N
                    if page < ring.sink_pages or page > last_page - ring.local_pages:
                        slot = page if page < ring.sink_pages else (
                            ring.sink_pages + (page - ring.sink_pages) % ring.local_pages)
                        tok.append(t + i)
                        pg.append(s.stream_pages[slot])
                        off.append(p % N)
            seqs.append(self._seq_plan(s, t, length, dev))
            t += s.num_new

        def tens(key):
            return tuple(torch.tensor(x, dtype=torch.long, device=dev) for x in writes[key])

        return StepPlan(seqs, t, tens("dd"), tens("dp"), tens("sd"), tens("sp"))

    def _seq_plan(self, s: SeqStep, t0: int, length: int, dev) -> SeqPlan:
        N = self.cache.page_size
        n_pages = -(-length // N)
        budget = self.sp.token_budget if s.token_budget is None else s.token_budget
        k = max(budget // N, 1)  # a budget under one page still keeps the last page
        dynamic = (s.decode and budget > 0 and length >= self.threshold(budget) and n_pages > k)
        select = False
        if s.decode:
            step = self._decode_steps.get(s.seq_id, 0)
            self._decode_steps[s.seq_id] = step + 1
            if dynamic:
                last = self._last_select.get(s.seq_id)
                select = last is None or step - last >= self.sp.reuse_interval
                if select:
                    self._last_select[s.seq_id] = step
            else:
                self._last_select.pop(s.seq_id, None)
        # Streaming heads read the ring as it is when they attend: after the write at decode,
        # before it at prefill (the chunk's own tokens come fresh).
        seen = length if s.decode else s.start
        slots = self.cache.ring.page_in_slot(seen) if self.cache.has_streaming else []
        live = [(r, i) for r, i in enumerate(slots) if i >= 0]
        return SeqPlan(
            step=s, t0=t0, t1=t0 + s.num_new, length=length,
            n_pages=n_pages, device=torch.device(dev),
            dynamic=dynamic, budget_pages=k, select=select,
            ring_pages=torch.tensor([s.stream_pages[r] for r, _ in live], dtype=torch.long, device=dev),
            ring_first_pos=torch.tensor([i * N for _, i in live], dtype=torch.long, device=dev),
        )
