"""The host KV tier's page cache on the cupy backend: which pages to fetch, and what was read.

The decode kernels read a dense page wherever it is (resident slot, or the mapped host pool over
PCIe; ``kernels/tier.cuh``), so fetching is only a cache: a selecting step's picks are copied to
the host asynchronously after it ran and installed into the resident set at later steps' plans
(:meth:`HostTier.fetch`, batched on the stream; a share of the layers each step), for the steps
that reuse or repeat the selection. Nothing here waits on the GPU except for picks at least one step old, which are done.
Hits and misses are counted from those picks against the residency the selecting step saw;
decode rows reading every page are counted as streamed reads at plan time (prefill chunks over a
cached past stage it in bulk copies and are counted there: :meth:`HostTier.scan`).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from lserve.cache.host_memory import upload
from lserve.cache.host_tier import HostTier

FETCH_BUDGET_S = 0.002
"""Host seconds a decode step's plan may spend installing picks (:class:`TierPicks`): below a long
context's GPU step (5-8 ms at 128k-1M for an 8B model), so the fetch overlaps it."""


class TierPicks:
    """Per-backend state of the plan-time fetches.

    Parameters
    ----------
    tier : HostTier
        The cache's tier (``mirror``).
    layer_kinds : sequence of (n_dense, selects, budget kind)
        Per layer, as :attr:`~lserve.attention.cupy_plan.PlanGeometry.layer_kinds`.
    reads : int
        Decode steps that read one selection (the reuse interval). A fetch's admission weighs
        them only without a staging area: a staged pick crosses the link once a selection
        however many steps read it, so installing it pays only through later selections
        (:attr:`admit_reads` is then 1: the repeats enter).
    budget_s : float
        Host seconds a step's plan may spend fetching (:data:`FETCH_BUDGET_S`).

    A selection's fetch is spread over the steps' plans, layer by layer: at most
    :attr:`layers_per_step` (ceil(layers / reads)) layers a step, and no more once the step's
    fetching has taken ``budget_s`` (one layer at least). Under async decode a plan runs while the
    GPU runs the step before, so host time within the GPU's step is free and host time beyond it
    lengthens every step: at 1M tokens on an H100 host one layer's fetch took ~1 ms, a whole
    selection ~30 ms. A selection not done when the next one's picks arrive is superseded (its
    remaining layers are skipped, counted in ``HostKVStats.fetch_layers_skipped``: the newer
    picks are the ones the next steps read); each selection starts at the layer where the last one
    stopped, so no layer is left out for good.
    """

    def __init__(self, tier: HostTier, layer_kinds, reads: int = 1, budget_s: float | None = None) -> None:
        self.tier = tier
        self.layer_kinds = tuple(layer_kinds)
        self.reads = reads
        #: What a fetch's admission weighs (:class:`~lserve.cache.tier_policy.RepeatAdmission`).
        self.admit_reads = 1 if tier.stage_slots else reads
        self.budget_s = FETCH_BUDGET_S if budget_s is None else budget_s
        self.layers_per_step = -(-len(self.layer_kinds) // max(reads, 1))
        self._last: list[list[int]] | None = None  # selection slots per budget kind of the last planned step
        self._copies: deque = deque()  # (event, pages [L, S, H, U], counts [L, S, H], slots, per-kind slots)
        self._todo: list | None = None  # [pages, counts, slots, kinds, layers done] of the selection being fetched
        self._cursor = 0  # the next layer to fetch (round robin over selections)

    def begin_step(self, sel_page: torch.Tensor | None, sel_cnt: torch.Tensor | None) -> None:
        """Before a step is planned: copy the last step's picks to the host (after it in stream
        order), and fetch those of earlier steps whose copies are done."""
        if self._last is not None and sel_page is not None:
            kinds, self._last = self._last, None
            slots = sorted({s for ks in kinds for s in ks})
            idx = upload(torch.tensor(slots, dtype=torch.long), sel_page.device)
            pages = torch.empty((sel_page.shape[0], len(slots), *sel_page.shape[2:]), dtype=torch.int32,
                                pin_memory=True)
            counts = torch.empty((sel_cnt.shape[0], len(slots), sel_cnt.shape[2]), dtype=torch.int32, pin_memory=True)
            pages.copy_(sel_page.index_select(1, idx), non_blocking=True)
            counts.copy_(sel_cnt.index_select(1, idx), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._copies.append((ev, pages, counts, slots, kinds))
        while self._copies:
            ev = self._copies[0][0]
            if len(self._copies) == 1 and not ev.query():
                break  # the step just before may still run: its picks wait for the next plan
            ev.synchronize()
            self.queue(*self._copies.popleft()[1:])
        self.advance()

    def queue(self, pages: torch.Tensor, counts: torch.Tensor, slots: list[int], kinds: list[list[int]]) -> None:
        """A selection's picks on the host (as :meth:`apply` takes them), to fetch over the next
        :meth:`advance` calls; it supersedes one still being fetched."""
        if self._todo is not None:
            self.tier.count_skipped_fetches(len(self.layer_kinds) - self._todo[4])
        self._todo = [pages, counts, slots, kinds, 0]

    def advance(self) -> None:
        """Fetch the next layers of the queued selection (class docstring: at most
        :attr:`layers_per_step`, within ``budget_s``), then one flush."""
        t0 = time.perf_counter()
        L = len(self.layer_kinds)
        for _ in range(self.layers_per_step):
            job = self._todo
            if job is None:
                break
            self.apply(*job[:4], layers=range(self._cursor, self._cursor + 1), flush=False)
            self._cursor = (self._cursor + 1) % L
            job[4] += 1
            if job[4] == L:
                self._todo = None
            if time.perf_counter() - t0 >= self.budget_s:
                break
        self.tier.flush()

    def apply(self, pages: torch.Tensor, counts: torch.Tensor, slots: list[int], kinds: list[list[int]],
              layers: range | None = None, flush: bool = True) -> None:
        """Fetch the picks ``pages[layer, j, head, :counts[layer, j, head]]`` of selection slot
        ``slots[j]`` in each selecting layer (of ``layers``, None: all) whose budget kind ``kinds``
        lists that slot under; then one flush (``flush``)."""
        col = {s: j for j, s in enumerate(slots)}
        p, c = pages.numpy(), counts.numpy()
        for layer in layers if layers is not None else range(len(self.layer_kinds)):
            nd, selects, kind = self.layer_kinds[layer]
            if not (nd and selects and kind < len(kinds) and kinds[kind]):
                continue
            cols = [col[s] for s in kinds[kind]]
            cnt = c[layer, cols, :nd]  # [n, nd]
            pick = p[layer, cols, :nd]  # [n, nd, U]
            used = np.arange(pick.shape[-1]) < cnt[..., None]
            head = np.broadcast_to(np.arange(nd)[:, None], pick.shape)  # each pick's dense head
            self.tier.fetch(layer, pick[used], streamed=True, heads=head[used], reads=self.admit_reads,
                            flush=False)
        if flush:
            self.tier.flush()  # every layer's installs and table entries at once

    def after_plan(self, st) -> None:
        """A step's tables are planned: remember its selecting slots, count its decode scans."""
        if st.nb:
            slot = st.fields["slot"]
            rows = st.host_table("sel_rows")[: st.n_sel_rows].tolist() if st.n_sel_rows else []
            kinds = [[int(slot[b]) for b in rows]] + [[int(slot[b]) for b in h.sel_rows] for h in st.kinds]
            if any(kinds):
                self._last = kinds
            self._count_decode_scans(st)

    def _count_decode_scans(self, st) -> None:
        """Decode rows that read every page of a layer (it does not select, or the row reads no
        selection in its budget kind): streamed reads of the pages not resident."""
        N = self.tier.page_size
        for b, s in enumerate(st.dec):
            layers = [i for i, (nd, sel, k) in enumerate(self.layer_kinds)
                      if nd and (not sel or not st.kind_fields(k)["dyn"][b])]
            if layers:
                self.tier.note_reads(s.step.dense_pages[: -(-s.length // N)], layers)


def bulk_copy(ranges: np.ndarray) -> None:
    """Copy the byte ranges ``ranges`` (int64 [3, n]: source, target, 16-byte words; see
    :meth:`HostTier.use_bulk_copy`) with one ``ls_page_copy`` launch on the current stream."""
    from lserve.kernels.loader import Variant, get_kernel, i32, launch, ptr

    n = ranges.shape[1]
    if not n:
        return
    dev = torch.device("cuda", torch.cuda.current_device())
    table = upload(torch.from_numpy(np.ascontiguousarray(ranges, dtype=np.int64)), dev)
    launch(get_kernel(Variant("page_copy", "bf16", 128), "ls_page_copy"), (n,), (256,), (ptr(table), i32(n)))

