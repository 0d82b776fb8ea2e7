"""Host metadata of one step of the CUDA backend, built once per step (numpy only, no CUDA).

:meth:`CupyPlanner.plan` turns a :class:`~lserve.sparsity.plan.StepPlan` into one
:class:`CupyStep`: the decode meta rows, page and ring tables, the rows that run the page
selector, the split-K unit tables of every layer kind, the virtual-sequence tables of prefill
chunks with cached past, the prefill tiles and, for CUDA-graph steps, the graph key and the
entry-count bounds the units are planned for. :meth:`CupyStep.pack` lays the int32 tables out
as one buffer and :meth:`CupyStep.bind` points the step's device fields at a device copy of it,
so a step costs one host-to-device transfer. ``CupyBackend.plan`` does all of this once per step
and hands the object to the layers in ``StepPlan.tables``; their launches only read it.

The planner also keeps what outlives a step: each sequence's selection-state slot, the dense
pages it had at its last selection and an int32 copy of its page list (extended in place).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from lserve.attention.chunked import streaming_prefix
from lserve.kernels.decode_args import META_FIELDS  # meta rows, read from kernels/decode_meta.cuh
from lserve.sparsity.plan import layer_budget

if TYPE_CHECKING:
    from lserve.cache.kv_cache import StreamRing
    from lserve.sparsity.plan import SeqPlan, SeqStep, StepPlan

MAX_CHUNK = 256  # entries per decode unit (shared-memory table in ls_decode)
PREFILL_BM = 64  # query rows per ls_prefill tile
MAX_DECODE_GQ = 8  # query heads of one KV head a decode CTA serves at most


def decode_query_heads(group: int) -> int:
    """Query heads of one KV head that one decode CTA serves: the largest divisor of the GQA
    ``group`` up to :data:`MAX_DECODE_GQ` (the CTAs of a KV head split its group evenly)."""
    return max(d for d in range(1, min(group, MAX_DECODE_GQ) + 1) if group % d == 0)


@dataclass(frozen=True)
class PlanGeometry:
    """What a step's tables depend on besides the step: the cache layout and the attention config."""

    page_size: int
    num_kv_heads: int
    group: int  # query heads per KV head
    nqs: int  # query-head slices per KV head in a decode work item (group // heads per CTA)
    qmode: bool  # select_mode "query": one selection per query head (else per KV head)
    sink_tokens: int
    local_tokens: int
    reuse_interval: int  # decode steps between selector runs
    ring: StreamRing | None  # the streaming heads' ring; None: the model has no streaming heads
    layer_kinds: tuple[tuple[int, bool, int], ...]  # (dense KV heads, layer selects, budget kind) per layer
    fast_prefill: bool = True  # prefill through the kernels (False: fp32 caches, the torch reference)
    # budget ratio of kinds 1, 2, ... (kind 0: the sequence's mean budget), from adaptive budgets
    budget_ratios: tuple[float, ...] = ()

    @classmethod
    def of(cls, backend, gq: int, fast_prefill: bool) -> PlanGeometry:
        """The geometry of an attention backend's cache and config.

        Parameters
        ----------
        backend : AttentionBackend
            Gives the cache, the sparsity config, the GQA group and which layers select.
        gq : int
            Query heads per decode CTA (``group // gq`` slices per KV head).
        fast_prefill : bool
            Prefill runs through the kernels (16-bit caches).
        """
        c, sp = backend.cache, backend.sp
        L = backend.model.num_layers
        selects = [backend.layer_selects(i) for i in range(L)]
        ratios = backend.layer_ratios or (None,) * L
        distinct = tuple(sorted({r for r, on in zip(ratios, selects) if on and r is not None}))
        kinds = tuple((c.n_dense[i], selects[i], distinct.index(ratios[i]) + 1 if selects[i] and ratios[i] is not None
                       else 0) for i in range(L))
        return cls(c.page_size, backend.model.num_kv_heads, backend.group, backend.group // gq,
                   sp.select_mode == "query", sp.sink_tokens, sp.local_tokens, sp.reuse_interval,
                   c.ring if c.has_streaming else None, kinds, fast_prefill, distinct)


@dataclass(frozen=True)
class SplitK:
    """How decode work is split into units: at most ``ctas`` units per launch (one wave), at
    least ``min_chunk`` table entries per unit; ``impl`` (``"tc"``/``"cuda"``) keys the tables."""

    ctas: int
    min_chunk: int
    impl: str


@dataclass
class UnitTable:
    """Split-K decomposition of the decode work of one layer kind (host side)."""

    n_units: int  # U
    n_work: int  # W: (decode sequence, KV head, query slice) work items
    chunk: int  # table entries per unit
    direct: bool  # every work item in one unit: no merge
    units: np.ndarray  # int32 [U, 2] (work item, split index)
    work_start: np.ndarray  # int32 [W + 1] first unit of each work item


@dataclass
class DecodeUnits:
    """A :class:`UnitTable` on the device, plus the merge's partial results (split work only)."""

    n_units: int
    n_work: int
    chunk: int
    direct: bool
    units: torch.Tensor  # int32 [U, 2] (work, split)
    work_start: torch.Tensor  # int32 [W + 1]
    part_o: torch.Tensor | None  # float32 [U, GQ, D]
    part_lse: torch.Tensor | None  # float32 [U, GQ]


@dataclass
class BudgetView:
    """What the selector and decode kernels of layers of one budget kind read.

    Kind 0 is the sequences' own (mean) budget; kind j >= 1 keeps ``layer_pages(ratio_j, K)``
    pages, and a sequence whose pages at its last selection are not more than that reads every
    page in those layers (``dyn`` cleared in its meta rows), as the torch backend does.
    """

    meta: torch.Tensor  # int32 [8 * nb]: the step's meta rows with this kind's ``kk`` / ``dyn``
    sel_rows: torch.Tensor  # int32 [>= n_sel_rows]: decode indices that select now in these layers
    n_sel_rows: int
    n_dynamic: int  # decode sequences whose dense heads read a selection in these layers
    sel_pages: int  # sum of K over the selecting rows


@dataclass
class KindHost:
    """Host side of one budget kind >= 1 of a step (see :class:`BudgetView`)."""

    kk: np.ndarray  # int32 [nb]
    dyn: np.ndarray  # int32 [nb]
    sel_rows: list[int]
    n_dynamic: int = 0  # rows with dyn set
    sel_pages: int = 0  # sum of kk over sel_rows

    def fields(self, base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``base`` meta fields with this kind's ``kk`` and ``dyn``."""
        return {**base, "kk": self.kk, "dyn": self.dyn}


@dataclass
class CupyStep:
    """Everything the kernels of one step read, shared by all layers.

    Host fields are set by :meth:`CupyPlanner.plan`; the device fields (torch int32 views) by
    :meth:`bind`, before which they are None.
    """

    nb: int  # decode sequences
    dec: list[SeqPlan]  # the decode sequences, in step order
    fields: dict[str, np.ndarray]  # meta fields (META_FIELDS) [nb] as numpy (for unit planning)
    kinds: list[KindHost] = field(default_factory=list)  # budget kinds 1, 2, ... (adaptive budgets)
    # int32 tables in upload order, named as the device fields below
    arrays: list[tuple[str, np.ndarray]] = field(default_factory=list)
    unit_tables: dict = field(default_factory=dict)  # (n_dense, selects, budget kind, impl) -> UnitTable
    need_slots: int = 0  # selection-state slots the step needs (all slots handed out, plus one)
    need_entries: int = 1  # selection entries per (slot, head) the step needs
    n_sel_rows: int = 0
    n_dynamic: int = 0  # decode sequences with page selection active
    sel_pages: int = 0  # sum of K over the selecting sequences
    max_np_sel: int = 0
    fast: list[SeqPlan] = field(default_factory=list)  # prefill with start == 0
    cont: list[SeqPlan] = field(default_factory=list)  # prefill chunks with cached past (start > 0)
    slow: list[SeqPlan] = field(default_factory=list)  # fp32 prefill (torch reference path)
    c_page_off: list = field(default_factory=list)  # (offset, P_j) of chunk j in c_pages
    n_tiles: int = 0
    # CUDA-graph steps: entry-count upper bounds the split-K units are planned for (so every
    # step with the same key shares one unit table), else None (planned for this step exactly)
    bounds: tuple[list[np.ndarray], np.ndarray, int] | None = None  # ([dense dynamic [nb] per kind], dense all [nb], ring)
    key: tuple | None = None  # CUDA-graph steps: what fixes the launch shapes
    # CUDA-graph steps: the packed int32 host tables (:meth:`pack`, no units), copied into the
    # static buffer the device fields view before the graph (or its capture) runs
    packed: np.ndarray | None = None
    # -- device fields (bind) -----------------------------------------------------------------
    meta: torch.Tensor | None = None  # int32 [8 * nb]
    pages: torch.Tensor | None = None  # int32 [nb, pages_stride]
    ring_pages: torch.Tensor | None = None  # int32 [nb, ring_stride]
    ring_pos: torch.Tensor | None = None
    sel_rows: torch.Tensor | None = None  # int32 [R]: decode indices that select now
    kind_meta: torch.Tensor | None = None  # int32 [n_kinds - 1, 8 * nb]: meta rows of budget kinds 1, ...
    kind_sel_rows: torch.Tensor | None = None  # int32 [n_kinds - 1, R_max]
    # Streaming heads of the ``cont`` chunks as one virtual batch (see CupyPlanner.cont_tables)
    c_loc: torch.Tensor | None = None  # [2, R] (stream page, offset) of each past token they see
    c_kmap: torch.Tensor | None = None  # [V] virtual row -> row of cat(past tokens [R], step tokens [T])
    c_qmap: torch.Tensor | None = None  # [V] virtual row -> step row of its query (past rows: any)
    c_src: torch.Tensor | None = None  # [C] virtual rows of the chunks' tokens
    c_dst: torch.Tensor | None = None  # [C] their step rows
    c_tiles: torch.Tensor | None = None  # [n, 2] prefill-kernel tiles over the chunk rows only
    c_seqs: torch.Tensor | None = None  # [m, 2] (first virtual row, virtual length)
    c_long: tuple | None = None  # c_loc, c_kmap, c_qmap, c_src, c_dst as long (CupyBackend.plan)
    c_pages: torch.Tensor | None = None  # int32 [sum of P_j]: dense pages of each ``cont`` chunk's sequence
    c_pages_long: torch.Tensor | None = None  # c_pages as long (CupyBackend.plan)
    tiles: torch.Tensor | None = None  # int32 [n_tiles, 2]
    seqs: torch.Tensor | None = None  # int32 [n_fast, 2]
    units: dict = field(default_factory=dict)  # (n_dense, selects, budget kind, impl) -> DecodeUnits
    # indices of ``cont`` chunks -> the paged prefill kernel's tables for their dense heads
    # (CupyBackend.paged_dense_chunks: built at the first layer that runs that set)
    paged_plans: dict = field(default_factory=dict)

    def kind_fields(self, kind: int) -> dict[str, np.ndarray]:
        """Host meta fields the layers of budget kind ``kind`` read."""
        return self.fields if kind == 0 else self.kinds[kind - 1].fields(self.fields)

    def budget(self, kind: int) -> BudgetView:
        """The device tables and counts of budget kind ``kind`` (after :meth:`bind`)."""
        if kind == 0:
            return BudgetView(self.meta, self.sel_rows, self.n_sel_rows, self.n_dynamic, self.sel_pages)
        h = self.kinds[kind - 1]
        return BudgetView(self.kind_meta[kind - 1], self.kind_sel_rows[kind - 1], len(h.sel_rows), h.n_dynamic,
                          h.sel_pages)

    def host_table(self, name: str) -> np.ndarray:
        """The host copy of the int32 table ``name`` (e.g. ``"pages"``); KeyError if the step has none."""
        for n, a in self.arrays:
            if n == name:
                return a
        raise KeyError(name)

    def pack(self, units: bool = True) -> np.ndarray:
        """The int32 tables as one flat buffer, in :attr:`arrays` order, then (``units``) each
        unit table's ``units`` and ``work_start``; :meth:`bind` reads a device copy of it."""
        parts = [a.reshape(-1) for _, a in self.arrays]
        if units:
            for t in self.unit_tables.values():
                parts += [t.units.reshape(-1), t.work_start]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def bind(self, dev: torch.Tensor, units: bool = True, gq: int = 1, head_dim: int = 1) -> None:
        """Point the device fields at consecutive slices of ``dev`` (int32, laid out by
        :meth:`pack` with the same ``units``). With ``units`` also set :attr:`units`, allocating
        the merge buffers (float32 ``[U, gq, head_dim]`` and ``[U, gq]``) of split work."""
        o = 0
        for name, a in self.arrays:
            setattr(self, name, dev[o: o + a.size].view(a.shape))
            o += a.size
        if units:
            self.units = {}
            for key, t in self.unit_tables.items():
                n = 2 * t.n_units + t.n_work + 1
                self.units[key] = device_units(t, dev[o: o + n], gq, head_dim)
                o += n


def device_units(t: UnitTable, dev: torch.Tensor, gq: int, head_dim: int) -> DecodeUnits:
    """``t`` over ``dev`` (int32 [2U + W + 1]: its units, then its work starts), with merge buffers."""
    U = t.n_units
    part_o = part_lse = None
    if not t.direct:
        part_o = torch.empty((U, gq, head_dim), dtype=torch.float32, device=dev.device)
        part_lse = torch.empty((U, gq), dtype=torch.float32, device=dev.device)
    return DecodeUnits(U, t.n_work, t.chunk, t.direct, dev[: 2 * U].view(U, 2), dev[2 * U:], part_o, part_lse)


def split_units(e: np.ndarray, ctas: int, min_chunk: int) -> UnitTable:
    """Split work items of ``e`` table entries each (int64 [W], every entry >= 1) into units:
    one chunk size for all, about ``ctas`` units in all (fewer when ``MAX_CHUNK`` caps the chunk)."""
    chunk = int(min(MAX_CHUNK, max(min_chunk, math.ceil(e.sum() / ctas))))
    nsplit = -(-e // chunk)
    while chunk < MAX_CHUNK and nsplit.sum() > ctas:  # ceilings overshoot: grow
        chunk += 1
        nsplit = -(-e // chunk)
    W, U = e.size, int(nsplit.sum())
    work_start = np.zeros(W + 1, dtype=np.int32)
    np.cumsum(nsplit, out=work_start[1:])
    work = np.repeat(np.arange(W, dtype=np.int32), nsplit)
    split = np.arange(U, dtype=np.int32) - np.repeat(work_start[:-1], nsplit)
    units = np.stack([work, split], axis=1).astype(np.int32)
    return UnitTable(U, W, chunk, bool(nsplit.max() == 1), units, work_start)


class CupyPlanner:
    """Builds the :class:`CupyStep` of each step and keeps per-sequence host state.

    Parameters
    ----------
    geometry : PlanGeometry
        The cache layout and attention config the tables are built for.

    Attributes
    ----------
    slots : dict[int, int]
        Selection-state slot of each sequence that has run with page selection (until released).
    free_slots : list[int]
        Slots of released sequences, handed out again first.
    nsel : dict[int, int]
        Dense pages of each such sequence at its last selector run (the kernels' ``nsel``).
    """

    def __init__(self, geometry: PlanGeometry) -> None:
        self.geometry = geometry
        self.slots: dict[int, int] = {}
        self.free_slots: list[int] = []
        self.nsel: dict[int, int] = {}
        self._np_pages: dict[int, tuple[list, np.ndarray, int]] = {}  # seq_id -> (list, int32 copy, length)

    # -- sequence state -------------------------------------------------------------------------
    def release(self, seq_id: int) -> None:
        """Forget a finished, aborted or preempted sequence (its slot is handed out again)."""
        self.nsel.pop(seq_id, None)
        self._np_pages.pop(seq_id, None)
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def slot_of(self, seq_id: int) -> int:
        """The sequence's selection-state slot (a free one, or a new one, on first use)."""
        slot = self.slots.get(seq_id)
        if slot is None:
            slot = self.free_slots.pop() if self.free_slots else len(self.slots)
            self.slots[seq_id] = slot
        return slot

    def page_array(self, step: SeqStep) -> np.ndarray:
        """``step.dense_pages`` as int32, kept per sequence and extended as its list grows (the
        scheduler appends to the same list), so a decode step converts O(new pages), not O(context).
        Entries past ``len(step.dense_pages)`` are spare room (zeros)."""
        lst, sid = step.dense_pages, step.seq_id
        ent = self._np_pages.get(sid)
        if ent is None or ent[0] is not lst or ent[2] > len(lst):
            arr = np.asarray(lst, dtype=np.int32)
            arr = np.concatenate((arr, np.zeros(max(64, arr.size), dtype=np.int32)))  # room to grow
        else:
            arr = ent[1]
            if len(lst) > arr.size:
                arr = np.concatenate((arr, np.zeros(max(len(lst) - arr.size, arr.size), dtype=np.int32)))
            arr[ent[2]: len(lst)] = lst[ent[2]:]
        self._np_pages[sid] = (lst, arr, len(lst))
        return arr

    # -- one step -------------------------------------------------------------------------------
    def plan(self, plan: StepPlan, static: bool = False, split: SplitK | None = None) -> CupyStep:
        """The host tables of one step.

        Parameters
        ----------
        plan : StepPlan
        static : bool
            A CUDA-graph step (decode sequences only): page tables padded to a bucket of the
            longest sequence (1/32..1/64 of its length), ring tables to the ring's size, and
            :attr:`CupyStep.bounds`/:attr:`CupyStep.key` set, so consecutive steps share a key
            and with it one graph. ``bounds`` stays None (and the tables empty) when a
            sequence's entries exceed them: the step then runs eagerly.
        split : SplitK, optional
            Plan the split-K unit tables of every layer kind (decode steps); None: leave
            :attr:`CupyStep.unit_tables` empty (:meth:`plan_units` can add them).

        Returns
        -------
        CupyStep
            Host fields set, device fields None. Updates the selection slots and ``nsel`` of
            the sequences that select now.
        """
        dec = [s for s in plan.seqs if s.step.decode]
        st = CupyStep(nb=len(dec), dec=dec, fields={f: np.zeros(len(dec), dtype=np.int32) for f in META_FIELDS})
        if st.nb and not self._decode_tables(st, static, split):
            return st  # a CUDA-graph step past its bounds: no tables, it runs eagerly
        self._prefill_tables(st, [s for s in plan.seqs if not s.step.decode])
        return st

    def _decode_tables(self, st: CupyStep, static: bool, split: SplitK | None) -> bool:
        """Meta rows, page / ring / selector tables, counts and unit tables of the decode
        sequences; False (tables left empty) when a CUDA-graph step exceeds its bounds."""
        npages = [-(-s.length // self.geometry.page_size) for s in st.dec]
        ring_pages, ring_pos = self._ring_tables(st, static)
        sel_rows = self._meta_rows(st, npages)
        st.kinds = self._budget_kinds(st.fields, sel_rows)
        st.need_slots, st.need_entries = len(self.slots) + len(self.free_slots) + 1, self._entries_needed(st)
        pstride = max(npages)
        if static:
            pstride = self._static_bounds(st, npages)
            if pstride is None:
                return False
        st.arrays += [("meta", np.stack([st.fields[f] for f in META_FIELDS]).reshape(-1)),
                      ("pages", self._page_table(st.dec, npages, pstride)),
                      ("ring_pages", ring_pages), ("ring_pos", ring_pos),
                      ("sel_rows", np.asarray(sel_rows or [0], dtype=np.int32))]
        st.arrays += self._kind_tables(st)
        self._decode_counts(st, sel_rows, npages)
        if static:
            st.max_np_sel = pstride if sel_rows else 0
            st.key = (st.nb, pstride, ring_pages.shape[1], tuple(st.fields["dyn"].tolist()),
                      tuple(st.fields["kk"].tolist()), tuple(sel_rows), tuple(tuple(h.dyn.tolist()) for h in st.kinds))
        if split is not None:
            st.unit_tables = self.plan_units(st, split)
        return True

    def _ring_tables(self, st: CupyStep, static: bool) -> tuple[np.ndarray, np.ndarray]:
        """(ring pages, first position of each) [nb, stride]: the streaming pages each decode
        sequence reads; the stride is the ring's size on CUDA-graph steps. Sets ``nring``."""
        g = self.geometry
        rings = []
        for s in st.dec:
            slots = g.ring.page_in_slot(s.length) if g.ring is not None else []
            rings.append([(s.step.stream_pages[r], i * g.page_size) for r, i in enumerate(slots) if i >= 0])
        rstride = max(1, max(len(r) for r in rings))
        if static:
            rstride = max(1, g.ring.num_slots if g.ring is not None else 1)
        ring_pages = np.zeros((st.nb, rstride), dtype=np.int32)
        ring_pos = np.zeros((st.nb, rstride), dtype=np.int32)
        for b, ring in enumerate(rings):
            for j, (p, pos) in enumerate(ring):
                ring_pages[b, j], ring_pos[b, j] = p, pos
            st.fields["nring"][b] = len(ring)
        return ring_pages, ring_pos

    def _meta_rows(self, st: CupyStep, npages: list[int]) -> list[int]:
        """Fill the decode meta fields; hand out selection slots and record ``nsel`` of the
        sequences that select now. Returns the rows that run the selector (mean budget)."""
        host, sel_rows = st.fields, []
        for b, s in enumerate(st.dec):
            host["tok"][b] = s.t0
            host["len"][b] = s.length
            host["npages"][b] = npages[b]
            host["kk"][b] = s.budget_pages
            if s.dynamic:
                sid = s.step.seq_id
                host["dyn"][b] = 1
                host["slot"][b] = self.slot_of(sid)
                if s.select or sid not in self.nsel:
                    self.nsel[sid] = npages[b]
                    sel_rows.append(b)
                host["nsel"][b] = self.nsel[sid]
        return sel_rows

    def _entries_needed(self, st: CupyStep) -> int:
        """Selection entries per (slot, head): the largest ``K - 1`` of any budget kind's dynamic
        rows, per query head in query mode (at least 1)."""
        g = self.geometry
        need = 1
        for kind in range(len(st.kinds) + 1):
            f = st.kind_fields(kind)
            dyn = f["dyn"] != 0
            if dyn.any():
                need = max(need, int(f["kk"][dyn].max() - 1) * (g.group if g.qmode else 1))
        return need

    def _page_table(self, dec: list[SeqPlan], npages: list[int], stride: int) -> np.ndarray:
        """int32 [nb, stride]: each decode sequence's dense pages, zero-padded."""
        pages = np.zeros((len(dec), stride), dtype=np.int32)
        for b, s in enumerate(dec):
            pages[b, : npages[b]] = self.page_array(s.step)[: npages[b]]
        return pages

    @staticmethod
    def _kind_tables(st: CupyStep) -> list[tuple[str, np.ndarray]]:
        """``kind_meta`` and ``kind_sel_rows`` of budget kinds 1, 2, ... (none without them)."""
        if not st.kinds:
            return []
        r_max = max(1, max(len(h.sel_rows) for h in st.kinds))
        kind_rows = np.zeros((len(st.kinds), r_max), dtype=np.int32)
        for j, h in enumerate(st.kinds):
            kind_rows[j, : len(h.sel_rows)] = h.sel_rows
        kind_meta = np.stack([np.stack([h.fields(st.fields)[f] for f in META_FIELDS]).reshape(-1) for h in st.kinds])
        return [("kind_meta", kind_meta), ("kind_sel_rows", kind_rows)]

    @staticmethod
    def _decode_counts(st: CupyStep, sel_rows: list[int], npages: list[int]) -> None:
        """The launch counts of the mean budget (selecting rows, dynamic rows, pages kept)."""
        st.n_sel_rows = len(sel_rows)
        st.n_dynamic = int(st.fields["dyn"].sum())
        st.sel_pages = int(sum(st.fields["kk"][b] for b in sel_rows))
        st.max_np_sel = max((npages[b] for b in sel_rows), default=0)

    def _prefill_tables(self, st: CupyStep, pre: list[SeqPlan]) -> None:
        """Sort prefill sequences into fresh, continued and fp32 ones; their int32 tables."""
        fast_ok, N = self.geometry.fast_prefill, self.geometry.page_size
        st.fast = [s for s in pre if s.step.start == 0 and fast_ok]
        st.cont = [s for s in pre if s.step.start > 0 and fast_ok]
        st.slow = [s for s in pre if not fast_ok]
        if st.cont:
            lists = [s.step.dense_pages[: -(-(s.step.start + s.step.num_new) // N)] for s in st.cont]
            st.c_page_off = [(o, len(p)) for o, p in zip(np.cumsum([0] + [len(p) for p in lists]), lists)]
            st.arrays.append(("c_pages", np.asarray([p for lst in lists for p in lst], dtype=np.int32)))
        if st.cont and self.geometry.ring is not None:
            st.arrays += self.cont_tables(st.cont)
        if st.fast:
            seqs = np.array([[s.t0, s.step.num_new] for s in st.fast], dtype=np.int32)
            tiles = np.array([[j, q0] for j, s in enumerate(st.fast) for q0 in range(0, s.step.num_new, PREFILL_BM)],
                             dtype=np.int32)
            st.n_tiles = len(tiles)
            st.arrays += [("seqs", seqs), ("tiles", tiles)]

    def _budget_kinds(self, host: dict[str, np.ndarray], sel_rows: list[int]) -> list[KindHost]:
        """Meta ``kk``/``dyn`` and selecting rows of each budget kind >= 1 (adaptive budgets):
        a dynamic row keeps :func:`~lserve.sparsity.plan.layer_budget` pages in those layers
        (against ``nsel``, its pages at the last selection), or reads every page there (``dyn``
        0, ``kk`` the mean budget's)."""
        g = self.geometry
        out = []
        for ratio in g.budget_ratios:
            kp = np.array([layer_budget(ratio, int(k), int(n), g.page_size) if d else 0
                           for k, n, d in zip(host["kk"], host["nsel"], host["dyn"])], dtype=np.int32)
            dyn = (kp != 0).astype(np.int32)
            kk = np.where(dyn != 0, kp, host["kk"]).astype(np.int32)
            rows = [b for b in sel_rows if dyn[b]]
            out.append(KindHost(kk, dyn, rows, int(dyn.sum()), int(sum(kk[b] for b in rows))))
        return out

    def _static_bounds(self, st: CupyStep, npages: list[int]) -> int | None:
        """Set ``st.bounds``; returns the padded page-table stride, or None if a bound fails."""
        g = self.geometry
        N = g.page_size
        h = st.fields
        longest = max(npages)
        # buckets of 1/32..1/64 of the length: a graph's split-K units cover at most ~3% of
        # entries that are not there (empty units), and a new capture every ~3% of growth
        step = max(1, 1 << max(0, longest.bit_length() - 6))
        pstride = -(-longest // step) * step
        # pages appended since the last selection: at most ceil((C - 1) / N) + 1
        fresh = -(-(g.reuse_interval - 1) // N) + 1
        dyn_ub = []
        for kind in range(len(st.kinds) + 1):
            f = st.kind_fields(kind)
            n_sel = (f["kk"] - 1) * (g.group if g.qmode else 1)
            ub = np.minimum(n_sel + fresh + 1, pstride)
            actual = n_sel + h["npages"] - h["nsel"] + 1
            if np.any((f["dyn"] != 0) & (actual > ub)):
                return None
            dyn_ub.append(ub.astype(np.int64))
        ring = g.ring.num_slots if g.ring is not None else 0
        st.bounds = (dyn_ub, np.full(st.nb, pstride, dtype=np.int64), ring)
        return pstride

    def cont_tables(self, cont: list[SeqPlan]) -> list[tuple[str, np.ndarray]]:
        """Host tables of the streaming heads of chunks with cached past, as one virtual batch.

        Sequence j becomes ``P_j`` past rows (the sink and last ``local`` tokens it can see,
        :func:`~lserve.attention.chunked.streaming_prefix`, read from its ring) followed by its
        ``n_j`` chunk rows; the fresh-sequence prefill kernel then computes the chunk rows exactly.
        Returns the named int32 tables ``c_loc`` .. ``c_seqs`` (see :class:`CupyStep`).
        """
        g = self.geometry
        N, ring = g.page_size, g.ring
        loc_p, loc_o, kmap, qmap, src, dst, tiles, seqs = [], [], [], [], [], [], [], []
        r = v = 0
        for s in cont:
            pos = np.concatenate([np.arange(a, b) for a, b in streaming_prefix(s.step.start, g.sink_tokens,
                                                                                g.local_tokens)])
            lp = pos // N
            slot = np.where(lp < ring.sink_pages, lp, ring.sink_pages + (lp - ring.sink_pages) % ring.local_pages)
            loc_p.append(np.asarray(s.step.stream_pages, dtype=np.int64)[slot])
            loc_o.append(pos % N)
            p, n = len(pos), s.t1 - s.t0
            kmap += [np.arange(r, r + p), -1 - np.arange(s.t0, s.t1)]  # -1 - t: step row t (fixed below)
            qmap += [np.full(p, s.t0), np.arange(s.t0, s.t1)]
            src.append(np.arange(v + p, v + p + n))
            dst.append(np.arange(s.t0, s.t1))
            tiles += [(len(seqs), q0) for q0 in range(p, p + n, PREFILL_BM)]
            seqs.append((v, p + n))
            r, v = r + p, v + p + n
        km = np.concatenate(kmap)
        km = np.where(km < 0, r + (-1 - km), km)
        i32 = lambda a: np.asarray(a, dtype=np.int32)  # noqa: E731
        return [("c_loc", i32(np.stack((np.concatenate(loc_p), np.concatenate(loc_o))))), ("c_kmap", i32(km)),
                ("c_qmap", i32(np.concatenate(qmap))), ("c_src", i32(np.concatenate(src))),
                ("c_dst", i32(np.concatenate(dst))), ("c_tiles", i32(tiles).reshape(-1, 2)),
                ("c_seqs", i32(seqs).reshape(-1, 2))]

    # -- split-K units --------------------------------------------------------------------------
    def plan_units(self, st: CupyStep, split: SplitK) -> dict:
        """The unit table of every layer kind of the model for the decode sequences of ``st``:
        ``{(n_dense, selects, budget kind, split.impl): UnitTable}`` in order of the kinds' first layers."""
        out = {}
        for nd, selects, kind in self.geometry.layer_kinds:
            key = (nd, selects, kind, split.impl)
            if key not in out:
                out[key] = split_units(self.decode_entries(st, nd, selects, kind), split.ctas, split.min_chunk)
        return out

    def decode_entries(self, st: CupyStep, nd: int, selects: bool, kind: int = 0) -> np.ndarray:
        """Table entries (pages, or ring pages) of each decode work item of a layer with ``nd``
        dense KV heads: int64 [nb * H_kv * nqs] in (sequence, KV head, query slice) order, each at
        least 1; upper bounds (selection plus fresh pages), or ``st.bounds`` on CUDA-graph steps."""
        g = self.geometry
        h = st.kind_fields(kind)
        hkv, nqs = g.num_kv_heads, g.nqs
        dyn = (h["dyn"] != 0) & selects
        if st.bounds is None:
            n_sel = (h["kk"] - 1) * (g.group if g.qmode else 1)
            e_dense = np.where(dyn, n_sel + h["npages"] - h["nsel"] + 1, h["npages"])  # [nb] upper bounds
            e_ring = h["nring"]
        else:  # a CUDA-graph step: bounds shared by every step of its key
            e_dense = np.where(dyn, st.bounds[0][kind], st.bounds[1])
            e_ring = np.full(st.nb, st.bounds[2])
        e = np.empty((st.nb, hkv, nqs), dtype=np.int64)
        e[:, :nd, :] = e_dense[:, None, None]
        e[:, nd:, :] = e_ring[:, None, None]
        return np.maximum(e.reshape(-1), 1)
