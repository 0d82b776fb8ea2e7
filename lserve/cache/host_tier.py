"""Host KV tier: dense heads' pages past a device-resident working set live in host memory.

See ``docs/host_kv_tier.md`` for the design. In short: the allocator, sequences and the prefix
cache keep *virtual* dense page ids; this module's page table maps each to a host slot (one for
all layers, -1: no host copy) and, per layer, to a resident slot (-1: not resident).

* A page without a host copy is *hot*: resident in every layer (being written, or in a decoding
  sequence's sink/local window). Full pages outside the window are spilled (copied to the host
  once); their resident copies are then clean and dropped without a copy back. The eviction
  policy keeps each layer's hot and clean pages apart (the tier tells it which), so looking for a
  victim walks clean pages only.
* The pages a step writes and its decoding sequences' windows are *pinned*: made resident at
  plan time (:meth:`HostTier.prepare`) and never evicted during the step.
* :meth:`HostTier.fetch` installs a layer's selected pages into resident slots (evicting by the
  policy); what does not fit is read from the host directly (:meth:`HostTier.locate`).
* Scans (a prefill chunk's past, decode below the selection threshold) read a sequence's pages
  in logical order: :meth:`HostTier.scan` splits them into resident slots and runs of consecutive
  host slots, and :meth:`HostTier.stage` copies those runs to the device with one bulk copy each.
  A sequence's pages are spilled to consecutive host slots in logical order where they are free,
  so its offloaded past is a handful of runs; a prefilling sequence's pages are protected in the
  eviction order (:class:`~lserve.cache.tier_policy.RecencyPolicy`), so its next chunk finds as
  much of its past resident as the resident set holds.

Both tiers are :class:`~lserve.cache.paged_pool.PagedPool` objects on devices given by the
caller; on the CPU both are plain tensors and a "copy" is a tensor copy.

With ``mirror`` (the cupy backend: the host pools are mapped pinned memory the GPU addresses) the
tier keeps a device copy of the page table, ``slot[layer, page]`` (resident slot, or ``-1 - host
slot``), that the kernels read (``kernels/tier.cuh``), and moves pages in batches: the copies a
call queues run as index copies on the current stream at :meth:`HostTier.flush` (the end of
:meth:`~HostTier.prepare`, :meth:`~HostTier.fetch`), in an order that keeps every read before a
later write of the same slot, then the changed table entries are written. Everything is ordered
with the step's kernels on that stream, so nothing waits on the host.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from lserve.cache import tier_policy
from lserve.cache.host_memory import upload
from lserve.cache.paged_pool import PagedPool
from lserve.cache.tier_policy import RecencyPolicy, RepeatAdmission


class Scan(NamedTuple):
    """Where a scan's pages are (:meth:`HostTier.scan`): positions (into the scanned list) read
    from resident slots ``res_slots``, positions read from the host, and those host pages as
    ``runs`` of consecutive host slots, (first slot, count), in the order of ``host_pos``."""

    res_pos: np.ndarray
    res_slots: np.ndarray
    host_pos: np.ndarray
    runs: list[tuple[int, int]]


class SeqSpan(NamedTuple):
    """One sequence's share of a step, as the tier needs it: its dense pages (logical order),
    tokens cached before the step, tokens cached after it, and whether it decodes."""

    seq_id: int
    pages: list[int]
    start: int
    length: int
    decode: bool


@dataclass
class HostKVStats:
    """Gauges and running totals of the host tier (engine stats ``host_kv``).

    ``resident_slots_used`` / ``resident_slots``: occupied / all resident slots over every layer;
    ``pages_on_host`` / ``host_pages``: host slots in use / all; ``hot_pages``: pages only on the
    device. ``hits`` / ``misses``: selected pages found resident / not, per layer and fetch;
    ``fetched``: pages (per layer) copied into the resident set; ``deferred``: missed picks the
    admission rule left on the host (:class:`~lserve.cache.tier_policy.RepeatAdmission`);
    ``streamed``: pages (per layer) read from the host without entering it; ``spilled``: pages copied to the host (all layers).
    ``prefill_streamed`` / ``prefill_bytes_h2d``: the share of ``streamed`` / ``bytes_h2d`` that
    prefill chunks read of their past; ``h2d_copies``: bulk copies (runs of consecutive host
    slots, per layer) that scans read the host with.
    ``bytes_h2d`` / ``bytes_d2h``: totals; ``step_bytes_*``: those of the latest step.
    ``fetch_layers_skipped``: layers of a selection whose picks were not fetched because the next
    selection arrived first (the cupy backend's per-step fetch budget, ``TierPicks``).
    ``staged_parts``: head parts of picks on the host that the cupy backend's staging kernel copied
    to the device (once a selection, every layer; their bytes are in ``bytes_h2d``, read from the
    device when the snapshot is taken: :meth:`HostTier.count_staged_by`).
    """

    resident_slots_used: int = 0
    resident_slots: int = 0
    pages_on_host: int = 0
    host_pages: int = 0
    hot_pages: int = 0
    hits: int = 0
    misses: int = 0
    fetched: int = 0
    deferred: int = 0
    streamed: int = 0
    spilled: int = 0
    prefill_streamed: int = 0
    prefill_bytes_h2d: int = 0
    h2d_copies: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    step_bytes_h2d: int = 0
    step_bytes_d2h: int = 0
    fetch_layers_skipped: int = 0
    staged_parts: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of selected pages found resident (1.0 before any selection)."""
        n = self.hits + self.misses
        return self.hits / n if n else 1.0


def pinned_bound(max_batched_tokens: int, max_num_seqs: int, page_size: int, sink_pages: int,
                 local_pages: int) -> int:
    """Most pages one step pins: the pages its tokens are written to (a chunk may straddle one
    page more than it fills) plus a window (sink, local and the page being written) per sequence."""
    return -(-max_batched_tokens // page_size) + max_num_seqs * (1 + sink_pages + local_pages)


TIER_LAYER_FIELDS = ("slot", "k", "v", "ks", "vs", "kz", "vz", "stage")
"""Pointers of one layer's ``TierLayer`` (``kernels/tier.cuh``), in order."""

STAGE_SHARE = 4
"""The staging area takes at most 1/STAGE_SHARE of the resident slots a step does not pin."""


def stage_entries(token_budget: int, page_size: int) -> int:
    """Selection entries per dense head one sequence's staging area holds: the pages a selection
    keeps by score (the budget's pages less the last, which the top-k always keeps and which is in
    the pinned window); 0 without a budget."""
    return max(token_budget // page_size - 1, 0)


def stage_slots(num_pages: int, pinned: int, max_num_seqs: int, entries: int) -> int:
    """Sequences (selection-state slots) the staging area serves: one per sequence decoded
    together, as far as :data:`STAGE_SHARE` of the resident slots beyond the pinned ones go."""
    if entries <= 0:
        return 0
    return max(0, min(max_num_seqs, (num_pages - pinned) // (STAGE_SHARE * entries)))


class _Phase:
    """Page copies of one direction (``"h2d"``: host -> resident, ``"d2h"``) that may run as one
    batch: none writes a slot another of them reads or writes."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.moves: dict[int, tuple[list[int], list[int]]] = {}  # layer -> (source slots, target slots)
        self.reads: set[tuple] = set()
        self.writes: set[tuple] = set()

    def conflicts_any(self, reads: set, writes: set) -> bool:
        return not (self.reads.isdisjoint(writes) and self.writes.isdisjoint(writes) and self.writes.isdisjoint(reads))

    def add_many(self, layer: int, src: list[int], dst: list[int], reads, writes) -> None:
        s, d = self.moves.setdefault(layer, ([], []))
        s += src
        d += dst
        self.reads.update(reads)
        self.writes.update(writes)


def _page_nbytes(t: torch.Tensor) -> int:
    """Bytes of one page of a pool's storage tensor (0 for a layer without heads; its stride is not)."""
    return t[0].numel() * t.element_size() if t.shape[0] else 0


def _copy(src: PagedPool, src_slot: int, dst: PagedPool, dst_slot: int) -> None:
    """Copy one page (data, scales, zero points) between pools that may sit on different devices."""
    for a, b in zip(src.tensors(), dst.tensors()):
        b[dst_slot].copy_(a[src_slot], non_blocking=False)


class HostTier:
    """The page table, the per-layer resident sets and the host slots of the dense pools.

    Parameters
    ----------
    resident : list of PagedPool
        Per layer, the device pool; its pages are the resident slots.
    host : list of PagedPool
        Per layer, the host pool (same heads, page size and quantization); one slot per page.
    num_pages : int
        Virtual dense pages (the allocator's size).
    page_size, sink_pages, local_pages : int
        Tokens per page and a dense head's window in pages (the streaming ring's).
    policy : callable
        Makes one layer's eviction policy (:class:`~lserve.cache.tier_policy.RecencyPolicy`).
    mirror : bool
        Keep the page table on the resident pools' device too (:attr:`slot_table`, the
        :meth:`layer_struct` the kernels take) and move pages in batches on the device's stream;
        both pools must then be addressable there (the host ones in mapped memory).
    host_views : list of list of Tensor, optional
        Per layer, the host pool's tensors (:meth:`PagedPool.tensors` order) as CPU tensors, the
        sources of :meth:`stage`'s bulk copies (mapped pools: their CPU twins); None: the host
        pools' own tensors.
    stage_slots, stage_entries : int
        The decode kernels' staging area (cupy backend; ``docs/host_kv_tier.md``): the last
        ``stage_slots * stage_entries`` resident slots of every layer are set aside and never hold
        a page; selection slot ``s``'s pick ``e``, when on the host, is copied once a selection to
        slot :attr:`stage_base` ``+ s * stage_entries + e`` (:func:`stage_slots`,
        :func:`stage_entries`). 0: none.
    """

    def __init__(self, resident: list[PagedPool], host: list[PagedPool], num_pages: int, page_size: int,
                 sink_pages: int, local_pages: int, policy: Callable[[], RecencyPolicy] = RecencyPolicy,
                 mirror: bool = False, host_views: list[list[torch.Tensor]] | None = None,
                 stage_slots: int = 0, stage_entries: int = 0) -> None:
        self.resident, self.host = resident, host
        self.num_layers = len(resident)
        self.page_size, self.sink_pages, self.local_pages = page_size, sink_pages, local_pages
        staged = stage_slots * stage_entries
        if staged and (not mirror or staged >= resident[0].num_pages):
            raise ValueError(f"a staging area of {staged} slots needs mirror and a larger resident set "
                             f"({resident[0].num_pages} slots)")
        #: Resident slots the tier gives pages (per layer); the staging area follows them.
        self.num_slots = resident[0].num_pages - staged
        self.stage_base, self.stage_slots, self.stage_entries = self.num_slots, stage_slots, stage_entries
        self.num_host = host[0].num_pages
        self._res = np.full((self.num_layers, num_pages), -1, dtype=np.int64)  # page -> resident slot
        self._host = np.full(num_pages, -1, dtype=np.int64)  # page -> host slot
        self._res_free = [list(range(self.num_slots - 1, -1, -1)) for _ in range(self.num_layers)]
        # free host slots: a mask, and a heap of them (lowest first; entries of slots taken out of
        # turn stay until popped) so spills fill the pool in order and runs stay long
        self._host_is_free = np.ones(self.num_host, dtype=bool)
        self._host_heap = list(range(self.num_host))
        self._host_nfree = self.num_host
        self._host_views = host_views or [h.tensors() for h in host]
        self._policy = [policy() for _ in range(self.num_layers)]
        self._admission = [RepeatAdmission() for _ in range(self.num_layers)]
        # the pages the current step pins (written, decoding windows), in the order they were pinned
        self._pinned: dict[int, None] = {}
        self._keep_new: set[int] = set()  # pages a prefilling sequence writes this step
        self._spilled_to: dict[int, int] = {}  # seq_id -> pages below this index were considered
        self._protected: dict[int, list[int]] = {}  # seq_id (prefilling) -> its pages protected so far
        self._page_bytes = [p.page_bytes() for p in resident]
        self._head_bytes = [p.page_bytes() // max(p.num_heads, 1) for p in resident]  # one head's part of a page
        self._stats = HostKVStats(resident_slots=self.num_slots * self.num_layers, host_pages=self.num_host)
        self.mirror = mirror
        self._phases: list[_Phase] = []  # queued copies (mirror), in an order that keeps them exact
        self._bulk_copy: Callable[[np.ndarray], None] | None = None  # use_bulk_copy
        self._bases: list[np.ndarray] = []  # use_bulk_copy: per layer [3, tensors] host/resident address, page bytes
        self._dirty: set[int] = set()  # pages whose table entries changed since the last flush
        self.slot_table: torch.Tensor | None = None
        self._structs: torch.Tensor | None = None
        self._staged: torch.Tensor | None = None  # count_staged_by: per layer, head parts staged (device)
        if mirror:
            dev = resident[0].k.device
            # -1 (host slot 0) for pages without data: never read, and the host pool is zeroed
            self.slot_table = torch.full((self.num_layers, num_pages), -1, dtype=torch.int32, device=dev)
            rows = [[self.slot_table[i].data_ptr()] + [0 if t is None else t.data_ptr() for t in
                    (h.k, h.v, h.k_scale, h.v_scale, h.k_zero, h.v_zero)] + [0] for i, h in enumerate(host)]
            self._structs = torch.tensor(rows, dtype=torch.int64).to(dev)

    # -- per step -----------------------------------------------------------------------------
    def prepare(self, seqs: Iterable[SeqSpan]) -> None:
        """Before a step runs: make the pages it writes and its decoders' windows resident
        (dropping stale host copies of written pages), then spill full pages that left a window."""
        st = self._stats
        st.step_bytes_h2d = st.step_bytes_d2h = 0
        seqs = list(seqs)
        N = self.page_size
        order, written, keep = [], [], set()  # pinned pages in logical order: eviction order follows
        for s in seqs:
            last = (s.length - 1) // N
            w = s.pages[s.start // N: last + 1]
            written += w
            order += w
            if s.decode:
                order += s.pages[: min(self.sink_pages, last + 1)]
                order += s.pages[max(0, last - self.local_pages + 1): last + 1]
                done = self._protected.pop(s.seq_id, None)
                if done:  # prefill is over: its pages are ordinary cache entries now
                    for pol in self._policy:
                        pol.unprotect(done)
            else:  # its past (read whole by the next chunk) goes protected, before this step evicts
                self._protect(s, s.start // N)
                keep.update(w)
        pinned = dict.fromkeys(order)
        before = self._pinned
        left = [v for v in before if v not in pinned]  # unpinned as most recent, in logical order
        for pol in self._policy:
            pol.unpin(left)
        self._pinned, self._keep_new = pinned, keep
        ids = np.fromiter(pinned, dtype=np.int64, count=len(pinned))
        absent = set(ids[~(self._res[:, ids] >= 0).all(axis=0)].tolist())  # in some layer; a freed page in none
        for v in pinned:
            if v in absent:
                self._make_resident(v)
        new = [v for v in pinned if v not in before or v in absent]
        for pol in self._policy:  # the policy skips pages it has pinned already
            pol.pin(new)
        for s in seqs:
            if not s.decode:  # the chunk's pages stay protected after the step
                self._protect(s, (s.length - 1) // N + 1)
        self._keep_new = set()
        for v in written:
            self._drop_host(v)
        for s in seqs:  # full (before this step) and older than the window: spill once
            hi = min(s.start // N, (s.length - 1) // N - self.local_pages + 1)
            lo = max(self._spilled_to.get(s.seq_id, 0), self.sink_pages)
            i = lo
            # while host slots are free: the last R - P of them are left to spills on demand (a
            # full host leaves at most R - P pages hot, so a step's pins still find slots)
            while i < hi and self._host_nfree:
                if self._host[s.pages[i]] < 0:
                    prev = self._host[s.pages[i - 1]] if i else -1
                    self._spill(s.pages[i], int(prev) + 1 if prev >= 0 else None)
                i += 1
            self._spilled_to[s.seq_id] = max(lo, i)
        self.flush()

    def fetch(self, layer: int, pages, streamed: bool = False, heads=None, reads: int = 1, flush: bool = True) -> None:
        """Install the selected ``pages`` (tensor or array, any shape) of ``layer`` into its
        resident set, as far as free slots and clean, unpinned, unselected victims allow; the rest
        stays on the host.

        ``streamed``: the picks of a step that already ran (the cupy backend fetches a step's
        selection for the steps after it): its misses were read from the host, and pages freed
        since are skipped. ``heads`` (same shape as ``pages``): the dense head of each pick; a
        kernel reads only its own head's part of a page, so a missed page cost the host link the
        parts of the heads that picked it, not the whole page (without ``heads``: the whole page);
        with ``heads``, the misses that enter are those :class:`RepeatAdmission` admits, ``reads``
        being how many steps read the selection. ``flush=False`` leaves the copies queued for one
        :meth:`flush` after the fetches of every layer (fewer, larger launches)."""
        pages = pages.detach().cpu().numpy() if isinstance(pages, torch.Tensor) else np.asarray(pages)
        want = np.unique(pages)
        res = self._res[layer]
        if streamed:
            want = want[(res[want] >= 0) | (self._host[want] >= 0)]
        miss = want[res[want] < 0]
        st = self._stats
        st.hits += len(want) - len(miss)
        st.misses += len(miss)
        install = miss
        if streamed and len(miss):
            parts = None
            if heads is not None:
                n = self.resident[layer].num_heads
                missed = (res[pages] < 0) & (self._host[pages] >= 0)  # the picks of pages in miss
                # (page, head) pairs as one sorted key: the pages come out in miss's (sorted) order
                pairs = np.unique(pages[missed] * n + np.asarray(heads)[missed])
                parts = len(pairs)
                if tier_policy.ADMIT_ON_REPEAT:
                    per_page = np.diff(np.flatnonzero(np.diff(pairs // n, prepend=-1, append=-1)))  # heads a page
                    install = miss[self._admission[layer].admit(miss, per_page, n, reads)]
                    st.deferred += len(miss) - len(install)
            self._count_streamed(layer, len(miss), parts)
        hits = want[res[want] >= 0].tolist()
        if len(install):  # the victim search (one walk) passes over the hits: they are needed
            self._install_many(layer, install, set(want.tolist()))
        self._policy[layer].touch(hits)  # behind the installs, as most recent
        if flush:
            self.flush()

    def _install_many(self, layer: int, pages: np.ndarray, needed: set[int]) -> None:
        """Install ``pages`` (missed, with host copies) of ``layer`` in order, as far as free slots
        and clean victims (not pinned, not ``needed``) go: what one :meth:`_slot` and
        :meth:`_install` a page would do, in batches (a fetch installs ~1,000 pages a selection at
        1M tokens; page by page that was ~30 ms of host time a selection)."""
        free = self._res_free[layer]
        n_free = min(len(pages), len(free))
        slots = free[len(free) - n_free:][::-1]  # the order pop() would give
        del free[len(free) - n_free:]
        pinned = self._pinned
        victims = self._policy[layer].victims(len(pages) - n_free, lambda p: p not in pinned and p not in needed)
        if victims:
            slots += self._evict_many(layer, np.asarray(victims, dtype=np.int64))
        pages = pages[: len(slots)].tolist()
        if not pages:
            return
        hs = self._host[pages]
        if self.mirror:
            self._queue_many("h2d", layer, hs.tolist(), slots)
        else:
            for h, slot in zip(hs.tolist(), slots):
                _copy(self.host[layer], h, self.resident[layer], slot)
        self._res[layer, pages] = slots
        self._dirty.update(pages)
        self._policy[layer].touch(pages)
        self._count_h2d(len(pages) * self._page_bytes[layer])
        self._stats.fetched += len(pages)

    def count_skipped_fetches(self, layers: int) -> None:
        """``layers`` layers of a selection were not fetched (superseded by the next selection)."""
        self._stats.fetch_layers_skipped += layers

    def note_reads(self, pages, layers=None) -> None:
        """Count ``pages`` read by ``layers`` (None: all) from wherever they are: those not resident
        are streamed from the host (the cupy backend's scans, counted at plan time)."""
        pages = np.unique(np.asarray(pages, dtype=np.int64))
        if not pages.size:
            return
        rows = range(self.num_layers) if layers is None else layers
        for layer in rows:
            r = self._res[layer][pages]
            n = int(((r < 0) & (self._host[pages] >= 0)).sum())
            if n:
                self._count_streamed(layer, n)

    def scan(self, layer: int, pages, prefill: bool = False) -> Scan:
        """Where ``layer`` reads ``pages`` (one sequence's, in order; a list or array) from, as a
        :class:`Scan`; the host pages count as streamed (``prefill``: also as a prefill chunk's
        past), and each run of consecutive host slots as one copy."""
        ids = np.asarray(pages, dtype=np.int64)
        r, h, on = self._where(layer, ids)
        host_pos = np.flatnonzero(~on)
        runs: list[tuple[int, int]] = []
        if host_pos.size:
            hs = h[host_pos]
            cut = np.flatnonzero(np.diff(hs) != 1) + 1
            first = np.concatenate(([0], cut))
            runs = list(zip(hs[first].tolist(), np.diff(np.concatenate((first, [hs.size]))).tolist()))
            n, st = int(host_pos.size), self._stats
            self._count_streamed(layer, n)
            st.h2d_copies += len(runs)
            if prefill:
                st.prefill_streamed += n
                st.prefill_bytes_h2d += n * self._page_bytes[layer]
        return Scan(np.flatnonzero(on), r[on], host_pos, runs)

    def stage(self, layer: int, runs: list[tuple[int, int]]) -> PagedPool:
        """``layer``'s host pages of ``runs`` (:attr:`Scan.runs`) copied, one bulk copy per run and
        storage tensor, into a new pool on the resident device, in order (in stream order on a GPU:
        after every earlier spill, before the reads that follow)."""
        p = self.resident[layer]
        dev = p.k.device
        n = sum(c for _, c in runs)
        pool = PagedPool(n, p.num_heads, p.page_size, p.head_dim, p.kv_quant, p.dtype, dev,
                         alloc=lambda shape, dt: torch.empty(shape, dtype=dt, device=dev))
        for dst, src in zip(pool.tensors(), self._host_views[layer]):
            o = 0
            for h0, c in runs:
                dst[o: o + c].copy_(src[h0: h0 + c], non_blocking=True)
                o += c
        return pool

    def device_slots(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As :meth:`locate`, from the device table (mirror only; no host sync, nothing counted)."""
        s = self.slot_table[layer][pages].long()
        return s.clamp(min=0), (-1 - s).clamp(min=0), s >= 0

    def layer_struct(self, layer: int) -> torch.Tensor:
        """``layer``'s ``TierLayer`` (:data:`TIER_LAYER_FIELDS`) on the device (mirror only)."""
        return self._structs[layer]

    def set_stage_maps(self, maps: torch.Tensor | None) -> None:
        """Point every layer's ``TierLayer.stage`` at ``maps[layer]`` (int32, laid out as the
        backend's selection: the staged slot of each pick on the host, or -1), or at nothing."""
        col = TIER_LAYER_FIELDS.index("stage")
        ptrs = [0] * self.num_layers if maps is None else [maps[i].data_ptr() for i in range(self.num_layers)]
        self._structs[:, col].copy_(torch.tensor(ptrs, dtype=torch.int64))

    def count_staged_by(self, counter: torch.Tensor) -> None:
        """Count the staging kernel's copies: ``counter[layer]`` (int64, on the device) is the head
        parts it has staged in ``layer``. :meth:`stats` adds them to ``staged_parts`` and their bytes
        to ``bytes_h2d``; a fetch's missed picks then count as streamed pages but not bytes (a
        missed pick crosses once, staged; picks the area does not hold, read in place, go uncounted)."""
        self._staged = counter

    def page_bases(self, layer: int) -> np.ndarray:
        """``layer``'s host and resident base addresses and page bytes of each storage tensor
        (int64 [3, tensors]; :meth:`use_bulk_copy` must have run): what a kernel that copies
        pages or head parts between the tiers addresses them by."""
        if not self._bases:
            raise RuntimeError("page_bases needs use_bulk_copy first")
        return self._bases[layer]

    def flush(self) -> None:
        """Run the queued copies, then write the changed table entries (mirror; else nothing is queued)."""
        if not self.mirror:
            self._dirty.clear()
            return
        if self._phases and self._bulk_copy is not None:  # one launch a phase (its order is free)
            for ph in self._phases:
                self._bulk_copy(self._ranges(ph))
        elif self._phases:  # every phase's slots in one upload, then per (phase, layer) copies of its views
            moves = [(ph.kind, layer, len(src)) for ph in self._phases for layer, (src, _) in ph.moves.items()]
            flat = [x for ph in self._phases for src, dst in ph.moves.values() for x in (src, dst)]
            dev = self.resident[0].k.device
            slots = upload(torch.from_numpy(np.concatenate(flat).astype(np.int64)), dev)
            at = 0
            for kind, layer, n in moves:
                si, di = slots[at: at + n], slots[at + n: at + 2 * n]
                at += 2 * n
                a, b = (self.host[layer], self.resident[layer]) if kind == "h2d" else (self.resident[layer], self.host[layer])
                for x, y in zip(a.tensors(), b.tensors()):
                    y.index_copy_(0, di, x.index_select(0, si))
        self._phases = []
        if self._dirty:
            v = np.fromiter(self._dirty, dtype=np.int64)
            self._dirty.clear()
            vals = np.where(self._res[:, v] >= 0, self._res[:, v], -1 - np.maximum(self._host[v], 0)[None, :])
            idx = (np.arange(self.num_layers)[:, None] * self._res.shape[1] + v[None, :]).reshape(-1)
            dev = self.slot_table.device
            self.slot_table.view(-1).index_copy_(0, upload(torch.from_numpy(idx), dev),
                                                 upload(torch.from_numpy(vals.reshape(-1).astype(np.int32)), dev))

    def use_bulk_copy(self, copy: Callable[[np.ndarray], None]) -> None:
        """Run :meth:`flush`'s page copies through ``copy(ranges)`` (mirror; the cupy backend's one
        kernel a batch): ``ranges`` int64 [3, n] holds each contiguous range's source and target
        address and its length in 16-byte words. Every storage tensor's page must be a multiple of
        16 bytes (pools on 16-byte boundaries, as allocations are); else this raises ValueError."""
        if not self.mirror:
            raise ValueError("bulk copies address the pools on the device: the tier needs mirror")
        for pool in (*self.resident, *self.host):
            for t in pool.tensors():
                if _page_nbytes(t) % 16 or t.data_ptr() % 16 or not t.is_contiguous():
                    raise ValueError(f"a {tuple(t.shape)} {t.dtype} pool's pages are not whole 16-byte words")
        self._bulk_copy = copy
        # per layer: host and resident base addresses and page bytes of each storage tensor (one
        # with pages: a layer without dense heads has none)
        self._bases = []
        for h, r in zip(self.host, self.resident):
            ts = [(x.data_ptr(), y.data_ptr(), _page_nbytes(x)) for x, y in zip(h.tensors(), r.tensors())]
            self._bases.append(np.array([t for t in ts if t[2]], dtype=np.int64).reshape(-1, 3).T)  # [3, tensors]

    def _ranges(self, ph: _Phase) -> np.ndarray:
        """The byte ranges of one phase's page copies (:meth:`use_bulk_copy`): each page of each
        storage tensor is one contiguous range."""
        cols = []
        for layer, (src, dst) in ph.moves.items():
            host, res, page = self._bases[layer]
            a, b = (host, res) if ph.kind == "h2d" else (res, host)
            si, di = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
            cols.append(np.stack(((a[:, None] + si * page[:, None]).ravel(), (b[:, None] + di * page[:, None]).ravel(),
                                  np.repeat(page // 16, si.size))))
        return np.concatenate(cols, axis=1) if cols else np.zeros((3, 0), dtype=np.int64)

    def _queue_many(self, kind: str, layer: int, src: list[int], dst: list[int]) -> None:
        """Queue page copies that touch distinct slots (mirror) as :meth:`_queue` would one by
        one: all into the latest phase of their kind that no later phase conflicts with any of,
        else a new phase at the end."""
        host_side = [("h", layer, x) for x in (src if kind == "h2d" else dst)]
        res_side = [("r", layer, x) for x in (dst if kind == "h2d" else src)]
        reads, writes = (host_side, res_side) if kind == "h2d" else (res_side, host_side)
        rs, ws = set(reads), set(writes)
        for ph in reversed(self._phases):
            clash = ph.conflicts_any(rs, ws)
            if ph.kind == kind and not clash:
                ph.add_many(layer, src, dst, reads, writes)
                return
            if clash:
                break
        ph = _Phase(kind)
        ph.add_many(layer, src, dst, reads, writes)
        self._phases.append(ph)

    def _queue(self, kind: str, layer: int, src: int, dst: int) -> None:
        """Queue one page copy (mirror): :meth:`_queue_many` of one."""
        self._queue_many(kind, layer, [src], [dst])

    def locate(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where ``layer``'s ``pages`` (any shape) are read from: (resident slot, host slot, resident?),
        long/long/bool tensors of the same shape on ``pages``' device (slots clamped to 0 where
        unused). Pages read from the host count as streamed."""
        pc = pages.detach().cpu().numpy()
        r, h, on_dev = self._where(layer, pc)
        if not on_dev.all():
            self._count_streamed(layer, np.unique(pc[~on_dev]).size)
        dev = pages.device
        return (torch.from_numpy(np.maximum(r, 0)).to(dev), torch.from_numpy(np.maximum(h, 0)).to(dev),
                torch.from_numpy(on_dev).to(dev))

    def resident_slots(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """Resident slots of pages a step writes in ``layer`` (pinned, so resident)."""
        r = self._res[layer][pages.detach().cpu().numpy()]
        if (r < 0).any():
            raise RuntimeError(f"host KV tier: layer {layer} writes a page that is not resident")
        return torch.from_numpy(r).to(pages.device)

    # -- lifetime -----------------------------------------------------------------------------
    def on_free(self, pages: Iterable[int]) -> None:
        """The allocator freed ``pages``: give back every slot they hold (table entries are
        written at the next flush: a freed page is not read before it is written again)."""
        v = np.unique(np.fromiter(pages, dtype=np.int64))
        if not v.size:
            return
        # page by page this was ~0.2-1.4 s for a 1M-token sequence: every layer's slots at once
        for layer in range(self.num_layers):
            held = v[self._res[layer, v] >= 0]
            if held.size:
                self._res_free[layer] += self._evict_many(layer, held)
        hs = self._host[v]
        on = hs >= 0
        if on.any():
            hs = hs[on]
            self._host_is_free[hs] = True
            self._host_nfree += int(hs.size)
            self._host_heap += hs.tolist()
            heapq.heapify(self._host_heap)
            self._host[v[on]] = -1
        self._dirty.update(v.tolist())

    def release(self, seq_id: int) -> None:
        """Forget a finished, aborted or preempted sequence's spill progress and protection."""
        self._spilled_to.pop(seq_id, None)
        done = self._protected.pop(seq_id, None)
        if done:
            for pol in self._policy:
                pol.unprotect(done)

    # -- views --------------------------------------------------------------------------------
    @property
    def fetched_pages(self) -> int:
        """Pages (per layer) installed by fetches so far: :attr:`HostKVStats.fetched` without the
        gauges :meth:`stats` counts over every layer's table (~1-2 ms at 1M tokens)."""
        return self._stats.fetched

    def stats(self) -> HostKVStats:
        """A snapshot of the counters."""
        st = self._stats
        st.resident_slots_used = int((self._res >= 0).sum())
        st.pages_on_host = self.num_host - self._host_nfree
        st.hot_pages = int(((self._res >= 0).all(axis=0) & (self._host < 0)).sum())
        snap = HostKVStats(**{k: getattr(st, k) for k in st.__dataclass_fields__})
        if self._staged is not None:  # a device read: stats are taken between steps, not in them
            parts = self._staged.cpu().numpy()
            snap.staged_parts = int(parts.sum())
            snap.bytes_h2d += int((parts * np.asarray(self._head_bytes, dtype=np.int64)).sum())
        return snap

    def held_pages(self) -> set[int]:
        """Virtual pages that hold a slot of either tier."""
        return set(np.flatnonzero((self._res >= 0).any(axis=0) | (self._host >= 0)).tolist())

    def is_resident(self, layer: int, page: int) -> bool:
        return bool(self._res[layer, page] >= 0)

    def check(self) -> None:
        """Raise RuntimeError if a slot is lost or owned twice, a page's data is nowhere, or (mirror)
        the device table differs from the host one (flushes and synchronizes)."""
        if self.mirror:
            self.flush()
            want = np.where(self._res >= 0, self._res, -1 - np.maximum(self._host, 0)[None, :])
            held = (self._res >= 0) | (self._host >= 0)[None, :]
            got = self.slot_table.cpu().numpy()
            if (got[held] != want[held]).any():
                raise RuntimeError("host KV tier: the device page table differs from the host one")
        def owned(table: np.ndarray, free: list[int], total: int, what: str) -> None:
            used = table[table >= 0].tolist()
            if len(set(used)) != len(used) or set(used) & set(free) or len(used) + len(free) != total \
                    or len(set(free)) != len(free):
                raise RuntimeError(f"host KV tier: {what} slots inconsistent ({len(used)} used, {len(free)} free "
                                   f"of {total})")
        for layer in range(self.num_layers):
            owned(self._res[layer], self._res_free[layer], self.num_slots, f"layer {layer} resident")
            if len(self._policy[layer]) != int((self._res[layer] >= 0).sum()) or \
                    self._policy[layer].pages(hot=True) != \
                    set(np.flatnonzero((self._res[layer] >= 0) & (self._host < 0)).tolist()):
                raise RuntimeError(f"host KV tier: layer {layer} policy out of step with its resident set")
        free = np.flatnonzero(self._host_is_free)
        owned(self._host, free.tolist(), self.num_host, "host")
        if len(free) != self._host_nfree or not set(free.tolist()) <= set(self._host_heap):
            raise RuntimeError("host KV tier: free host slots out of step with their heap")
        partial = (self._res >= 0).any(axis=0) & ~(self._res >= 0).all(axis=0) & (self._host < 0)
        if partial.any():
            raise RuntimeError(f"host KV tier: page {int(np.flatnonzero(partial)[0])} lost its data in some layer")

    # -- moves --------------------------------------------------------------------------------
    def _count_h2d(self, n: int) -> None:
        self._stats.bytes_h2d += n
        self._stats.step_bytes_h2d += n

    def _protect(self, s: SeqSpan, end: int) -> None:
        """Protect a prefilling sequence's pages up to logical page ``end`` in every layer's eviction order."""
        prot = self._protected.setdefault(s.seq_id, [])
        new = s.pages[len(prot): end]
        for pol in self._policy:
            pol.protect(new)
        prot += new

    def _count_streamed(self, layer: int, n: int, head_parts: int | None = None) -> None:
        """``n`` pages of ``layer`` read from the host without entering the resident set: whole
        pages, or ``head_parts`` single heads' parts of them."""
        self._stats.streamed += n
        if head_parts is None:
            self._count_h2d(n * self._page_bytes[layer])
        elif self._staged is None:  # else the staging kernel's count has their bytes
            self._count_h2d(head_parts * self._head_bytes[layer])

    def _where(self, layer: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Resident slots, host slots and "resident" of ``layer``'s pages ``ids`` (any shape),
        which must all hold data (a read of a page with none is a bookkeeping error)."""
        r, h = self._res[layer][ids], self._host[ids]
        on = r >= 0
        if not (on | (h >= 0)).all():
            bad = int(ids[~(on | (h >= 0))].ravel()[0])
            raise RuntimeError(f"host KV tier: page {bad} of layer {layer} is read but holds no data")
        return r, h, on

    def _slot(self, layer: int, evictable: Callable[[int], bool]) -> int | None:
        """A free resident slot of ``layer``, evicting the policy's clean victim among ``evictable``
        (the policy walks clean pages only, so every candidate has a host copy: :meth:`check`)."""
        if not self._res_free[layer]:
            victim = self._policy[layer].victim(evictable)
            if victim is None:
                return None
            self._evict(layer, victim)
        return self._res_free[layer].pop()

    def _make_resident(self, v: int) -> None:
        """Resident in every layer (a pinned page): a free slot, else a clean unpinned victim, else
        a hot unpinned page spilled first (the start-up sizing guarantees a host slot for it)."""
        for layer in range(self.num_layers):
            if self._res[layer, v] >= 0:
                self._policy[layer].touch((v,), v in self._keep_new)
                continue
            slot = self._slot(layer, lambda p: p not in self._pinned)
            if slot is None:
                hot = self._policy[layer].victim(lambda p: p not in self._pinned, hot=True)
                if hot is None:
                    raise RuntimeError("host KV tier: every resident slot is pinned (resident pool too small)")
                self._spill(hot)
                self._evict(layer, hot)
                slot = self._res_free[layer].pop()
            if self._host[v] >= 0:
                self._install(layer, v, slot)
            else:  # a fresh page: written this step, hot until spilled
                self._res[layer, v] = slot
                self._policy[layer].touch((v,), v in self._keep_new, hot=True)
                self._dirty.add(v)

    def _install(self, layer: int, v: int, slot: int) -> None:
        if self.mirror:
            self._queue("h2d", layer, int(self._host[v]), slot)
        else:
            _copy(self.host[layer], int(self._host[v]), self.resident[layer], slot)
        self._res[layer, v] = slot
        self._dirty.add(v)
        self._policy[layer].touch((v,), v in self._keep_new)
        self._count_h2d(self._page_bytes[layer])

    def _take_host(self, hint: int | None) -> int:
        """A free host slot: ``hint`` where it is one, else the lowest."""
        free = self._host_is_free
        if hint is None or not (0 <= hint < self.num_host and free[hint]):
            if not self._host_nfree:
                raise RuntimeError("host KV tier: no free host slot to spill to")
            while not free[self._host_heap[0]]:
                heapq.heappop(self._host_heap)
            hint = heapq.heappop(self._host_heap)
        free[hint] = False
        self._host_nfree -= 1
        return hint

    def _spill(self, v: int, hint: int | None = None) -> None:
        """Copy hot page ``v`` (resident in every layer) to a host slot (``hint`` if it is free:
        the slot after its predecessor's, so a sequence's pages form runs)."""
        hs = self._take_host(hint)
        for layer in range(self.num_layers):
            if self.mirror:
                self._queue("d2h", layer, int(self._res[layer, v]), hs)
            else:
                _copy(self.resident[layer], int(self._res[layer, v]), self.host[layer], hs)
            self._policy[layer].set_hot(v, False)  # clean: a victim candidate now
        self._host[v] = hs
        self._dirty.add(v)
        st = self._stats
        st.spilled += 1
        n = sum(self._page_bytes)
        st.bytes_d2h += n
        st.step_bytes_d2h += n

    def _evict(self, layer: int, v: int) -> None:
        self._res_free[layer] += self._evict_many(layer, np.array([v], dtype=np.int64))

    def _evict_many(self, layer: int, pages: np.ndarray) -> list[int]:
        """``pages`` (resident in ``layer``) leave its resident set; returns their slots (the
        caller frees or reuses them)."""
        slots = self._res[layer, pages].tolist()
        self._res[layer, pages] = -1
        pl = pages.tolist()
        self._policy[layer].forget_many(pl)
        self._dirty.update(pl)
        return slots

    def _drop_host(self, v: int) -> None:
        """Free ``v``'s host slot; where it is resident it turns hot (out of the victim search)."""
        if self._host[v] >= 0:
            for layer in np.flatnonzero(self._res[:, v] >= 0).tolist():
                self._policy[layer].set_hot(v, True)
            hs = int(self._host[v])
            self._host_is_free[hs] = True
            self._host_nfree += 1
            heapq.heappush(self._host_heap, hs)
            self._host[v] = -1
            self._dirty.add(v)
