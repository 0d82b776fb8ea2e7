"""Per-step plan: host-side metadata shared by every attention backend.

The scheduler describes each sequence of a step with a :class:`SeqStep`; the
:class:`StepPlanner` turns the batch into a :class:`StepPlan`: where new tokens are written in
both pools, which pages each sequence reads, whether dynamic page selection is active for a
sequence and whether the selector runs this step or reuses its last choice (every C steps).
A backend's ``plan`` adds what its layers need beyond that (:attr:`StepPlan.tables`; the cupy
backend's int32 device tables), once per step, before the first layer runs.

:func:`layer_budget` is the one rule of per-layer page budgets (adaptive budgets), asked by
both backends and the KV-read meter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import torch

from lserve.cache.kv_cache import KVCache
from lserve.config import SparsityConfig
from lserve.sparsity.adaptive_budget import layer_pages


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
    prefill_sparsity: float | None = None  # per-request override of SparsityConfig.prefill_sparsity
    prefill_end: int = 0  # tokens cached when this prefill reaches its first sample (0: unknown)


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
    ring: list  # (streaming page, position of its first token) of each ring slot holding data
    pages_at_select: int = 0  # dense pages at the selection this step uses (when dynamic)

    @cached_property
    def pages(self) -> torch.Tensor:
        """long [n]: dense pages, logical order (built on first use: O(context) host work that
        the CUDA kernels' backend, which reads ``step.dense_pages``, never asks for)."""
        return torch.tensor(self.step.dense_pages[: self.n_pages], dtype=torch.long, device=self.device)

    # The ring as tensors, built on first use too: the torch backend reads them, the CUDA
    # kernels' backend builds its own tables (two tensors per sequence and step saved there).
    @cached_property
    def ring_pages(self) -> torch.Tensor:
        """long [R]: streaming pages to read (slots holding data)."""
        return _long([p for p, _ in self.ring], self.device)

    @cached_property
    def ring_first_pos(self) -> torch.Tensor:
        """long [R]: position of the first token of each page of :attr:`ring_pages`."""
        return _long([pos for _, pos in self.ring], self.device)


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
    #: What the backend's layers read besides the fields above, built by its ``plan`` (cupy: a
    #: :class:`~lserve.attention.cupy_plan.CupyStep` on the device); None: nothing (torch).
    tables: object | None = None

    def to(self, device) -> StepPlan:
        """The same plan with every tensor on ``device`` (a host-built plan run eagerly), without
        :attr:`tables` (they were built for this plan's form: the backend builds them again)."""
        def mv(t):
            return t.to(device)

        seqs = [replace(s, device=torch.device(device)) for s in self.seqs]
        return StepPlan(seqs, self.num_tokens, *(tuple(mv(t) for t in w) for w in (
            self.dense_write_decode, self.dense_write_prefill, self.stream_write_decode, self.stream_write_prefill)))


def layer_budget(ratio: float | None, budget_pages: int, pages_at_select: int, page_size: int) -> int:
    """Pages a selecting layer reads from a dynamic sequence's selection; 0: it reads every page.

    The layer keeps ``layer_pages(ratio, budget_pages)`` pages (``ratio`` None: the sequence's
    own budget) and reads every page while that is at least the sequence's dense pages at its
    last selection, so the choice changes only when the selection does and a reused selection
    always exists. The torch backend, the cupy planner and the KV-read meter all decide here.
    """
    k = layer_pages(ratio, budget_pages, page_size)
    return k if k < pages_at_select else 0


def _long(values, dev) -> torch.Tensor:
    """int64 tensor of a list or array on ``dev`` (through numpy: ~5x cheaper than
    ``torch.tensor`` on a short list, which matters on the per-step decode path)."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(dev)


class StepPlanner:
    """Builds :class:`StepPlan` objects and remembers, per sequence, when it last selected."""

    def __init__(self, sparsity: SparsityConfig, cache: KVCache, device) -> None:
        self.sp = sparsity
        self.cache = cache
        self.device = device
        self._decode_steps: dict[int, int] = {}
        self._last_select: dict[int, int] = {}
        self._select_pages: dict[int, int] = {}  # seq_id -> n_pages when it last selected
        # dynamic_threshold -1 (auto): selection runs from ratio * budget tokens (set by the
        # engine from the device's profile; 0 = whenever the context exceeds the budget).
        self.threshold_ratio = 0.0
        # False when no layer selects (``select_layers``; set by the backend): decode steps are
        # then planned as below the threshold, every dense head reading every page.
        self.selects = True

    def threshold(self, budget: int) -> int:
        """Context length from which dynamic selection runs for ``budget``."""
        if self.sp.dynamic_threshold >= 0:
            return self.sp.dynamic_threshold
        return math.ceil(self.threshold_ratio * budget)

    def selection_state(self, seq_id: int) -> tuple[int, int | None]:
        """Where a sequence stands in the reuse rule.

        Returns
        -------
        next_step : int
            Index the sequence's coming decode step will get (0 before its first).
        last_select : int or None
            Decode step of its last selection, None if the selector may run at the next step.
        """
        return self._decode_steps.get(seq_id, 0), self._last_select.get(seq_id)

    def set_last_selection(self, seq_id: int, step: int | None) -> None:
        """Record ``step`` as the sequence's last selection, or forget it (``None``: the selector
        may run at its next decode step). Tools that override the reuse interval use this."""
        if step is None:
            self._last_select.pop(seq_id, None)
        else:
            self._last_select[seq_id] = step

    def release(self, seq_id: int) -> None:
        """Forget a finished, aborted or preempted sequence."""
        self._decode_steps.pop(seq_id, None)
        self._last_select.pop(seq_id, None)
        self._select_pages.pop(seq_id, None)

    def plan(self, steps: list[SeqStep], host: bool = False) -> StepPlan:
        """The step's plan; ``host``: tensors on the CPU (CUDA-graph steps copy them in one go)."""
        dev = torch.device("cpu") if host else self.device
        seqs: list[SeqPlan] = []
        # (token row, page, offset) write locations per pool ("d"ense / "s"tream) and step kind
        # ("d"ecode / "p"refill): Python lists for short steps (decode: a few entries, where
        # numpy's per-call cost would dominate), int64 arrays for long ones (a 128k-token prefill
        # took ~0.25 s of Python per step).
        writes = {key: ([], [], []) for key in ("dd", "dp", "sd", "sp")}
        arrays = {key: ([], [], []) for key in ("dd", "dp", "sd", "sp")}
        t = 0
        for s in steps:
            length = s.start + s.num_new
            if len(s.dense_pages) * self.cache.page_size < length:
                raise ValueError(f"sequence {s.seq_id}: {len(s.dense_pages)} pages cannot hold {length} tokens")
            key = "d" if s.decode else "p"
            if s.num_new > 16:
                self._writes_np(s, t, length, arrays["d" + key], arrays["s" + key])
            else:
                self._writes_py(s, t, length, writes["d" + key], writes["s" + key])
            seqs.append(self._seq_plan(s, t, length, dev))
            t += s.num_new

        def tens(key):
            return tuple(_long(np.concatenate([*arrs, np.asarray(lst, dtype=np.int64)]) if arrs else lst, dev)
                         for lst, arrs in zip(writes[key], arrays[key]))

        return StepPlan(seqs, t, tens("dd"), tens("dp"), tens("sd"), tens("sp"))

    def _stream_keep(self, length: int):
        """(sink pages, local pages, last page): tokens on pages below ``sink`` or above
        ``last - local`` are still in the ring after a step ending at ``length``; only they are
        written (no slot is written twice)."""
        ring = self.cache.ring
        return ring.sink_pages, ring.local_pages, (length - 1) // self.cache.page_size

    def _writes_py(self, s: SeqStep, t: int, length: int, dense: tuple, stream: tuple) -> None:
        N = self.cache.page_size
        pos = range(s.start, length)
        dense[0].extend(range(t, t + s.num_new))
        dense[1].extend(s.dense_pages[p // N] for p in pos)
        dense[2].extend(p % N for p in pos)
        if self.cache.has_streaming:
            sp, lp, last = self._stream_keep(length)
            for i, p in enumerate(pos):
                pg = p // N
                if pg < sp or pg > last - lp:
                    stream[0].append(t + i)
                    stream[1].append(s.stream_pages[pg if pg < sp else sp + (pg - sp) % lp])
                    stream[2].append(p % N)
            base = self.cache.shadow_base
            if base is not None and not s.decode:  # prefix cache: every prefilled token's shadow copy
                stream[0].extend(range(t, t + s.num_new))
                stream[1].extend(base + s.dense_pages[p // N] for p in pos)
                stream[2].extend(p % N for p in pos)

    def _writes_np(self, s: SeqStep, t: int, length: int, dense: tuple, stream: tuple) -> None:
        N = self.cache.page_size
        pos = np.arange(s.start, length, dtype=np.int64)
        page = pos // N
        first = s.start // N
        table = np.asarray(s.dense_pages[first: (length - 1) // N + 1], dtype=np.int64)
        rows = np.arange(t, t + s.num_new, dtype=np.int64)
        dense[0].append(rows)
        dense[1].append(table[page - first])
        dense[2].append(pos % N)
        if self.cache.has_streaming:
            sp, lp, last = self._stream_keep(length)
            keep = (page < sp) | (page > last - lp)
            kp = page[keep]
            slot = np.where(kp < sp, kp, sp + (kp - sp) % lp)
            stream[0].append(rows[keep])
            stream[1].append(np.asarray(s.stream_pages, dtype=np.int64)[slot])
            stream[2].append(pos[keep] % N)
            if self.cache.shadow_base is not None and not s.decode:  # prefix cache: shadow copies
                stream[0].append(rows)
                stream[1].append(self.cache.shadow_base + table[page - first])
                stream[2].append(pos % N)

    def _seq_plan(self, s: SeqStep, t0: int, length: int, dev) -> SeqPlan:
        N = self.cache.page_size
        n_pages = -(-length // N)
        budget = self.sp.token_budget if s.token_budget is None else s.token_budget
        k = max(budget // N, 1)  # a budget under one page still keeps the last page
        dynamic = (self.selects and s.decode and budget > 0 and length >= self.threshold(budget) and n_pages > k)
        select = False
        if s.decode:
            step = self._decode_steps.get(s.seq_id, 0)
            self._decode_steps[s.seq_id] = step + 1
            if dynamic:
                last = self._last_select.get(s.seq_id)
                select = last is None or step - last >= self.sp.reuse_interval
                if select:
                    self._last_select[s.seq_id] = step
                    self._select_pages[s.seq_id] = n_pages
            else:
                self._last_select.pop(s.seq_id, None)
                self._select_pages.pop(s.seq_id, None)
        # Streaming heads read the ring as it is when they attend: after the write at decode,
        # before it at prefill (the chunk's own tokens come fresh).
        seen = length if s.decode else s.start
        slots = self.cache.ring.page_in_slot(seen) if self.cache.has_streaming else []
        return SeqPlan(
            step=s, t0=t0, t1=t0 + s.num_new, length=length,
            n_pages=n_pages, device=torch.device(dev),
            dynamic=dynamic, budget_pages=k, select=select,
            ring=[(s.stream_pages[r], i * N) for r, i in enumerate(slots) if i >= 0],
            pages_at_select=self._select_pages.get(s.seq_id, n_pages) if dynamic else 0,
        )
