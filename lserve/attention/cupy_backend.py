"""CUDA backend: the block-sparse kernels of ``kernels/`` (compiled by CuPy), same semantics as
:class:`~lserve.attention.torch_backend.TorchBackend`.

Per layer ``run`` does, on torch's current stream:

1. ``ls_kv_write``: decode tokens' K/V into the dense pool and the streaming ring (quantized as
   configured) plus the key statistics (before attention, so a token attends to itself).
2. Page selection (only when some decode sequence has ``SeqPlan.select`` and the layer
   selects): ``ls_page_scores_tc`` (tensor cores; ``ls_page_scores`` on CUDA cores for fp32
   caches) + ``ls_page_topk`` write the selection state (logical page indices, per (layer,
   sequence slot, dense KV head)) on the GPU. Steps that reuse a selection
   launch nothing: the decode kernel reads the stored state and appends every page from the one
   that was last at selection time (exactly ``TorchBackend._page_mask``).
3. ``ls_decode_tc`` (tensor cores, bf16/fp16 pools) or ``ls_decode`` (CUDA cores, fp32 or
   INT8/INT4 pools dequantized on load): ONE launch for all decode sequences and all KV heads
   (split-K over units sized to one wave of resident CTAs), then ``ls_decode_merge`` when any
   work item has several splits.
4. Prefill without cached past (``start == 0``): dense heads through torch SDPA (flash; faster
   than our mma.sync kernel, see ``lserve.bench.kernels``), streaming heads through
   ``ls_prefill``, which visits only the sink and local key blocks of each query tile. Chunked
   prefill with cached past (``start > 0``): :mod:`lserve.attention.chunked` (fused attention
   with log-sum-exp merge for dense heads, a virtual sequence through ``ls_prefill`` for
   streaming heads). fp32 models fall back to the torch reference code (correct, not fast).
5. ``ls_kv_write`` again for the prefill tokens (after attention, as the reference does).

On sm_90+ the decode-step kernels (1-3 and the merge) are launched as programmatic dependents
(``kernels/pdl.py``): each starts while the previous kernel drains and waits in-kernel
(``pdl_wait``) before reading what it wrote; on a step whose layer ran no top-k the decode
kernel reads the stored selection before waiting.

Host work happens once per step (the first layer of a plan): int32 tables are packed into one
buffer and copied in one transfer; per (n_dense, selects) layer kind a split-K unit table.

CUDA graphs: with a fixed plan every launch of ``run`` is capturable (no host sync, no
allocation outside torch's allocator; ``lserve.bench.kernels`` captures decode steps). For
engine-level capture across steps, the per-step tables would have to live in fixed-capacity
device buffers updated by one copy before replay, the grid sized by capacity with empty units
exiting early (the kernels already take every count from device memory except the unit count
and the split chunk), and the selector's ``select`` flag moved into ``meta`` so that the
select and reuse graphs differ only by one branch in the kernels.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from lserve.attention.base import AttentionBackend
from lserve.attention.chunked import causal_attention, causal_impl, dense_chunk, streaming_prefix
from lserve.attention.torch_backend import TorchBackend
from lserve.kernels.pdl import available as pdl_available
from lserve.sparsity.plan import SeqPlan, StepPlan

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
LOG2E = 1.4426950408889634
MAX_CHUNK = 256  # entries per decode unit (shared-memory table in ls_decode)
TOPK_THREADS = 512
SCORE_PAGES_MAX = 128  # PPB_MAX in kernels/selector.cu
PREFILL_BM = 64
# Fresh prompts at least this long run their dense heads through SDPA (cuDNN on the H200); shorter
# ones (the served path's chunks) through flash: cuDNN builds an execution plan per new shape
# (~8 ms of host time per layer shape, `scripts/probe_mixed.py`: a first 256-token chunk next to
# decodes took 265 ms), which only a long prompt's attention pays back.
CUDNN_MIN_TOKENS = 16384
# meta rows (see kernels/decode.cu)
META_FIELDS = ("tok", "len", "npages", "nring", "nsel", "slot", "dyn", "kk")


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _check_rows(t: torch.Tensor, dtype: torch.dtype, heads: int, d: int, name: str, device: torch.device) -> None:
    """A [T, H, D] tensor whose rows can be addressed as base + t * stride(0) + h * D + i."""
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the cache on {device}")
    if t.dim() != 3 or t.shape[1] != heads or t.shape[2] != d:
        raise ValueError(f"{name}: expected [T, {heads}, {d}], got {list(t.shape)}")
    if t.stride(2) != 1 or t.stride(1) != d or t.stride(0) % 8 or t.data_ptr() % 16:
        raise ValueError(f"{name}: rows must be contiguous [H, D] blocks, 16-byte aligned (strides {t.stride()})")


@dataclass
class _Units:
    """Split-K decomposition of the decode work for one layer kind (n_dense, selects)."""

    n_units: int
    n_work: int
    chunk: int
    direct: bool
    units: torch.Tensor  # int32 [U, 2] (work, split)
    work_start: torch.Tensor  # int32 [W + 1]
    part_o: torch.Tensor | None  # float32 [U, GQ, D]
    part_lse: torch.Tensor | None  # float32 [U, GQ]


@dataclass
class _Step:
    """Device tables of one StepPlan, shared by all layers."""

    plan: StepPlan
    nb: int  # decode sequences
    dec: list[SeqPlan]
    host: dict[str, np.ndarray]  # meta fields [nb] as numpy (for unit planning)
    meta: torch.Tensor | None = None  # int32 [8 * nb]
    pages: torch.Tensor | None = None  # int32 [nb, pages_stride]
    ring_pages: torch.Tensor | None = None  # int32 [nb, ring_stride]
    ring_pos: torch.Tensor | None = None
    sel_rows: torch.Tensor | None = None  # int32 [R]: decode indices that select now
    n_sel_rows: int = 0
    n_dynamic: int = 0  # decode sequences with page selection active
    sel_pages: int = 0  # sum of K over the selecting sequences
    max_np_sel: int = 0
    fast: list[SeqPlan] = field(default_factory=list)  # prefill with start == 0
    cont: list[SeqPlan] = field(default_factory=list)  # prefill chunks with cached past (start > 0)
    slow: list[SeqPlan] = field(default_factory=list)  # fp32 prefill (torch reference path)
    # Streaming heads of the ``cont`` chunks as one virtual batch (see _cont_tables): int32 tables
    c_loc: torch.Tensor | None = None  # [2, R] (stream page, offset) of each past token they see
    c_kmap: torch.Tensor | None = None  # [V] virtual row -> row of cat(past tokens [R], step tokens [T])
    c_qmap: torch.Tensor | None = None  # [V] virtual row -> step row of its query (past rows: any)
    c_src: torch.Tensor | None = None  # [C] virtual rows of the chunks' tokens
    c_dst: torch.Tensor | None = None  # [C] their step rows
    c_tiles: torch.Tensor | None = None  # [n, 2] prefill-kernel tiles over the chunk rows only
    c_seqs: torch.Tensor | None = None  # [m, 2] (first virtual row, virtual length)
    c_long: tuple | None = None  # c_loc, c_kmap, c_qmap, c_src, c_dst as long (built by the first layer)
    c_pages: torch.Tensor | None = None  # int32 [sum of P_j]: dense pages of each ``cont`` chunk's sequence
    c_page_off: list = field(default_factory=list)  # (offset, P_j) of chunk j in c_pages
    c_pages_long: torch.Tensor | None = None  # c_pages as long (built by the first layer)
    tiles: torch.Tensor | None = None  # int32 [n_tiles, 2]
    seqs: torch.Tensor | None = None  # int32 [n_fast, 2]
    n_tiles: int = 0
    units: dict = field(default_factory=dict)
    # CUDA-graph steps: entry-count upper bounds the split-K units are planned for (so every
    # step with the same key shares one unit table), else None (planned for this step exactly)
    bounds: tuple[np.ndarray, np.ndarray, int] | None = None  # (dense dynamic [nb], dense all [nb], ring)
    key: tuple | None = None


class CupyBackend(AttentionBackend):
    """Block-sparse attention through the CUDA kernels in ``kernels/``.

    Parameters
    ----------
    model, sparsity, cache
        As for :class:`~lserve.attention.base.AttentionBackend`; the cache must be on a CUDA
        device with head_dim 64, 128 or 256 and a page size that is a multiple of 4.

    Attributes
    ----------
    decode_impl : str
        ``"tc"`` (tensor cores; bf16/fp16 unquantized pools, the default there) or ``"cuda"``.
    target_ctas : int or None
        Most decode units per launch (split-K granularity); None: one wave of resident CTAs.
    min_chunk : int
        Fewest table entries per decode unit (default 2: fewer, longer units and splits).
    prefill_dense : str
        ``"sdpa"`` (default) or ``"kernel"``: what runs the dense heads at prefill.
    score_impl : str
        ``"tc"`` (tensor cores, ``ls_page_scores_tc``; the default for bf16/fp16 caches whose
        page holds 1, 2, 4, 8 or 16 logical pages) or ``"cuda"`` (``ls_page_scores``).
    score_hpc : int or None
        Dense heads per CTA of the CUDA-core page-score kernel (1, 2 or 4; None: the largest that
        divides the layer's dense heads).
    score_ppb : int or None
        Physical pages per page-score CTA (None: sized for one wave of ~3 CTAs per SM).
    pdl : bool
        Launch the decode-step kernels (cache write, page scores, top-k, decode, merge) as
        programmatic dependents of the kernel before them (``kernels/pdl.py``), so each starts
        while the previous one drains. Default: on where supported (sm_90+), unless the
        environment sets ``LSERVE_PDL=0``.
    """

    name = "cupy"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from lserve.kernels.loader import KernelError

        pool = self.cache.dense[0] if self.cache.dense[0].num_heads else self.cache.stream[0]
        self.device = pool.k.device
        self.dtype = pool.dtype
        self._check_device()
        if self.dtype not in DTYPE_NAMES:
            raise KernelError(f"unsupported cache dtype {self.dtype}")
        self.D = self.model.head_dim
        if self.D not in (64, 128, 256):
            raise KernelError(f"the cupy backend supports head_dim 64, 128, 256 (got {self.D})")
        if self.cache.page_size % 4:
            raise KernelError(f"the cupy backend needs a page size that is a multiple of 4 (got {self.cache.page_size})")
        if self.group > 32:
            raise KernelError(f"GQA groups above 32 query heads are not supported (got {self.group})")
        self.dt_name = DTYPE_NAMES[self.dtype]
        self.kv_quant = self.cache.cfg.kv_quant
        self.gq = _largest_divisor_at_most(self.group, 8)
        self.nqs = self.group // self.gq
        self.qmode = self.sp.select_mode == "query"
        self.hkv = self.model.num_kv_heads
        self.g_log = self.cache.cfg.pages_per_logical
        self.num_sms = self._num_sms()
        # Tensor-core decode for 16-bit unquantized pools; CUDA cores (dequantize on load) else.
        self.decode_impl = "tc" if self.dtype != torch.float32 and self.kv_quant == "none" else "cuda"
        self.target_ctas: int | None = None  # None: one wave of resident decode CTAs
        self.min_chunk = 2
        self.prefill_dense = "sdpa"
        tc_scores = self.dtype != torch.float32 and self.g_log in (1, 2, 4, 8, 16)
        self.score_impl = "tc" if tc_scores else "cuda"
        self.score_hpc: int | None = None  # dense heads per page-score CTA (None: 4, 2 or 1)
        self.score_ppb: int | None = None  # physical pages per page-score CTA (None: one wave)
        self.pdl = os.environ.get("LSERVE_PDL", "1") != "0" and pdl_available(torch.cuda.get_device_capability(self.device))
        self.qscale = self.scale * LOG2E
        # The oracle's code serves fp32 prefill (and gathers the dense past of later chunks).
        self._ref = TorchBackend(self.model, self.sp, self.cache)
        # Selection state (logical page indices) per (layer, slot, dense head).
        self._slots: dict[int, int] = {}
        self._free_slots: list[int] = []
        self._np_pages: dict[int, tuple[list, np.ndarray, int]] = {}  # seq_id -> (list, int32 copy, length)
        self._nsel: dict[int, int] = {}
        self._hd_max = max(self.cache.n_dense) if self.cache.n_dense else 0
        self._sel_idx = self._sel_mask = self._sel_cnt = None
        self._sel_page: torch.Tensor | None = None  # the physical pages of _sel_idx (decode_tc reads these)
        self._cap_slots = 0
        self._cap_u = 0
        self._step: _Step | None = None
        self._static: torch.Tensor | None = None  # int32 tables of CUDA-graph steps
        self._static_units: dict = {}  # step key -> {(nd, selects, impl): _Units}
        self.static_generation = 0  # bumped when a buffer graphs point into is reallocated
        self._scores_buf: torch.Tensor | None = None  # last page-score buffer (benchmarks time top-k alone)
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        self._no_writes = (empty, empty, empty)
        self._head_rows: dict[int, torch.Tensor] = {}  # n heads -> long [n, 1] (gather rows)
        # Chunks with cached past: dense heads in one flash call over the whole sequence, their
        # keys written first (exact only unquantized); else past and chunk merged by LSE.
        self.flash = causal_impl(self.device, self.dtype, self.D) if self.dtype != torch.float32 else None
        self.one_call = self.flash is not None and self.kv_quant == "none"

    def _check_device(self) -> None:
        from lserve.kernels.loader import KernelError

        if self.device.type != "cuda":
            raise KernelError("the cupy backend needs the cache on a CUDA device")

    def _num_sms(self) -> int:
        return torch.cuda.get_device_properties(self.device).multi_processor_count

    # -- kernels --------------------------------------------------------------------------------
    def _kernel(self, family: str, name: str, quant: str = "none", gq: int = 1):
        from lserve.kernels.loader import Variant, get_kernel

        return get_kernel(Variant(family, self.dt_name, self.D, quant, gq), name)

    # -- sequence state -------------------------------------------------------------------------
    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self._nsel.pop(seq_id, None)
        self._np_pages.pop(seq_id, None)
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _page_array(self, step) -> np.ndarray:
        """``step.dense_pages`` as int32, kept per sequence and extended as its list grows (the
        scheduler appends to the same list), so a decode step converts O(new pages), not O(context)."""
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

    def _slot_of(self, seq_id: int) -> int:
        slot = self._slots.get(seq_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slots)
            self._slots[seq_id] = slot
        return slot

    def _ensure_state(self, n_slots: int, u_needed: int) -> None:
        """Grow the selection-state buffers to hold ``n_slots`` slots of ``u_needed`` entries."""
        if n_slots <= self._cap_slots and u_needed <= self._cap_u:
            return
        slots = max(n_slots, 2 * self._cap_slots, 8)
        cap_u = max(u_needed, self._cap_u)
        L, H = self.model.num_layers, max(self._hd_max, 1)
        idx = torch.zeros((L, slots, H, cap_u), dtype=torch.int32, device=self.device)
        page = torch.zeros_like(idx)
        cnt = torch.zeros((L, slots, H), dtype=torch.int32, device=self.device)
        msk = torch.zeros((L, slots, H, cap_u) if self.qmode else (1,), dtype=torch.int32, device=self.device)
        if self._sel_idx is not None:
            s, u = self._cap_slots, self._cap_u
            idx[:, :s, :, :u] = self._sel_idx
            page[:, :s, :, :u] = self._sel_page
            cnt[:, :s] = self._sel_cnt
            if self.qmode:
                msk[:, :s, :, :u] = self._sel_mask
        self._sel_idx, self._sel_cnt, self._sel_mask, self._sel_page = idx, cnt, msk, page
        self._cap_slots, self._cap_u = slots, cap_u
        self.static_generation += 1  # captured graphs point at the old buffers
        self._static_units.clear()

    # -- per-step tables ------------------------------------------------------------------------
    def _tables(self, plan: StepPlan) -> _Step:
        if self._step is not None and self._step.plan is plan:
            return self._step
        st, chunks = self._host_tables(plan)
        if chunks:
            flat = np.concatenate([a.reshape(-1) for _, a in chunks])
            self._bind(st, chunks, torch.from_numpy(flat).to(self.device, non_blocking=False))
        self._step = st
        return st

    @staticmethod
    def _bind(st: _Step, chunks: list[tuple[str, np.ndarray]], dev: torch.Tensor) -> None:
        """Point the step's device tables at consecutive slices of ``dev`` (int32)."""
        o = 0
        for name, a in chunks:
            setattr(st, name, dev[o: o + a.size].view(a.shape))
            o += a.size

    # -- CUDA-graph steps -----------------------------------------------------------------------
    def static_tables(self, plan: StepPlan) -> tuple[tuple, np.ndarray] | None:
        """Tables of a decode-only step in a capturable form, or None (run it eagerly).

        Page tables are padded to a bucket of the longest sequence (1/32..1/64 of its length),
        ring tables to the ring's size, and the split-K units are planned for entry-count
        upper bounds, so consecutive steps share a key, and with it one CUDA graph. Returns
        (key, int32 host tables); the step is bound to :attr:`static_buffer`, which the caller
        fills with the host tables before the graph (or its eager warm-up) runs.
        """
        if not plan.seqs or any(not s.step.decode for s in plan.seqs):
            return None
        st, chunks = self._host_tables(plan, static=True)
        if st.bounds is None:
            return None
        flat = np.concatenate([a.reshape(-1) for _, a in chunks])
        if self._static is None or self._static.numel() < flat.size:
            self._static = torch.empty(max(flat.size, 2 * (0 if self._static is None else self._static.numel()),
                                           4096), dtype=torch.int32, device=self.device)
            self.static_generation += 1
        self._bind(st, chunks, self._static)
        st.units = self._static_units.setdefault(st.key, {})
        self._step = st
        return (st.key, self.static_generation), flat

    @property
    def static_buffer(self) -> torch.Tensor:
        """The device buffer every CUDA-graph step's tables live in (int32)."""
        return self._static

    def _static_bounds(self, st: _Step, npages: list[int]) -> int | None:
        """Set ``st.bounds``; returns the padded page-table stride, or None if a bound fails."""
        N = self.cache.page_size
        h = st.host
        longest = max(npages)
        # buckets of 1/32..1/64 of the length: a graph's split-K units cover at most ~3% of
        # entries that are not there (empty units), and a new capture every ~3% of growth
        step = max(1, 1 << max(0, longest.bit_length() - 6))
        pstride = -(-longest // step) * step
        n_sel = (h["kk"] - 1) * (self.group if self.qmode else 1)
        # pages appended since the last selection: at most ceil((C - 1) / N) + 1
        fresh = -(-(self.sp.reuse_interval - 1) // N) + 1
        dyn_ub = np.minimum(n_sel + fresh + 1, pstride)
        actual = n_sel + h["npages"] - h["nsel"] + 1
        if np.any((h["dyn"] != 0) & (actual > dyn_ub)):
            return None
        ring = self.cache.ring.num_slots if self.cache.has_streaming else 0
        st.bounds = (dyn_ub.astype(np.int64), np.full(st.nb, pstride, dtype=np.int64), ring)
        return pstride

    def _host_tables(self, plan: StepPlan, static: bool = False) -> tuple[_Step, list[tuple[str, np.ndarray]]]:
        """Host side of :meth:`_tables`: the step's metadata and its int32 tables, not uploaded."""
        N = self.cache.page_size
        dec = [s for s in plan.seqs if s.step.decode]
        pre = [s for s in plan.seqs if not s.step.decode]
        nb = len(dec)
        host = {f: np.zeros(nb, dtype=np.int32) for f in META_FIELDS}
        st = _Step(plan=plan, nb=nb, dec=dec, host=host)
        chunks: list[tuple[str, np.ndarray]] = []
        if nb:
            npages = [-(-s.length // N) for s in dec]
            pstride = max(npages)
            rings = []
            for s in dec:
                if self.cache.has_streaming:
                    slots = self.cache.ring.page_in_slot(s.length)
                    rings.append([(s.step.stream_pages[r], i * N) for r, i in enumerate(slots) if i >= 0])
                else:
                    rings.append([])
            rstride = max(1, max(len(r) for r in rings))
            if static:
                rstride = max(1, self.cache.ring.num_slots if self.cache.has_streaming else 1)
            ring_pages = np.zeros((nb, rstride), dtype=np.int32)
            ring_pos = np.zeros((nb, rstride), dtype=np.int32)
            sel_rows = []
            u_needed = 1
            for b, s in enumerate(dec):
                for j, (p, pos) in enumerate(rings[b]):
                    ring_pages[b, j], ring_pos[b, j] = p, pos
                host["tok"][b] = s.t0
                host["len"][b] = s.length
                host["npages"][b] = npages[b]
                host["nring"][b] = len(rings[b])
                host["kk"][b] = s.budget_pages
                if s.dynamic:
                    sid = s.step.seq_id
                    host["dyn"][b] = 1
                    host["slot"][b] = self._slot_of(sid)
                    if s.select or sid not in self._nsel:
                        self._nsel[sid] = npages[b]
                        sel_rows.append(b)
                    host["nsel"][b] = self._nsel[sid]
                    u_needed = max(u_needed, (s.budget_pages - 1) * (self.group if self.qmode else 1))
            self._ensure_state(len(self._slots) + len(self._free_slots) + 1, u_needed)
            if static:
                pstride = self._static_bounds(st, npages)
                if pstride is None:
                    return st, []
            pages = np.zeros((nb, pstride), dtype=np.int32)
            for b, s in enumerate(dec):
                pages[b, : npages[b]] = self._page_array(s.step)[: npages[b]]
            meta = np.stack([host[f] for f in META_FIELDS]).reshape(-1)
            chunks += [("meta", meta), ("pages", pages), ("ring_pages", ring_pages), ("ring_pos", ring_pos),
                       ("sel_rows", np.asarray(sel_rows or [0], dtype=np.int32))]
            st.n_sel_rows = len(sel_rows)
            st.n_dynamic = int(host["dyn"].sum())
            st.sel_pages = int(sum(host["kk"][b] for b in sel_rows))
            st.max_np_sel = max((npages[b] for b in sel_rows), default=0)
            if static:
                st.max_np_sel = pstride if sel_rows else 0
                st.key = (nb, pstride, rstride, tuple(host["dyn"].tolist()), tuple(host["kk"].tolist()),
                          tuple(sel_rows))
        fast_ok = self.dtype != torch.float32
        st.fast = [s for s in pre if s.step.start == 0 and fast_ok]
        st.cont = [s for s in pre if s.step.start > 0 and fast_ok]
        st.slow = [s for s in pre if not fast_ok]
        if st.cont:
            lists = [s.step.dense_pages[: -(-(s.step.start + s.step.num_new) // N)] for s in st.cont]
            st.c_page_off = [(o, len(p)) for o, p in zip(np.cumsum([0] + [len(p) for p in lists]), lists)]
            chunks.append(("c_pages", np.asarray([p for lst in lists for p in lst], dtype=np.int32)))
        if st.cont and self.cache.has_streaming:
            chunks += self._cont_tables(st.cont)
        if st.fast:
            seqs = np.array([[s.t0, s.step.num_new] for s in st.fast], dtype=np.int32)
            tiles = np.array([[j, q0] for j, s in enumerate(st.fast) for q0 in range(0, s.step.num_new, PREFILL_BM)],
                             dtype=np.int32)
            st.n_tiles = len(tiles)
            chunks += [("seqs", seqs), ("tiles", tiles)]
        return st, chunks

    def _cont_tables(self, cont: list[SeqPlan]) -> list[tuple[str, np.ndarray]]:
        """Host tables of the streaming heads of chunks with cached past, as one virtual batch.

        Sequence j becomes ``P_j`` past rows (the sink and last ``local`` tokens it can see,
        :func:`~lserve.attention.chunked.streaming_prefix`, read from its ring) followed by its
        ``n_j`` chunk rows; the fresh-sequence prefill kernel then computes the chunk rows exactly.
        """
        N, ring = self.cache.page_size, self.cache.ring
        loc_p, loc_o, kmap, qmap, src, dst, tiles, seqs = [], [], [], [], [], [], [], []
        r = v = 0
        for s in cont:
            pos = np.concatenate([np.arange(a, b) for a, b in streaming_prefix(s.step.start, self.sp.sink_tokens,
                                                                                self.sp.local_tokens)])
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

    def decode_ctas(self) -> int:
        """Decode units per launch: one wave of resident CTAs, so no tail wave idles the GPU."""
        if self.target_ctas is not None:
            return self.target_ctas
        if self.decode_impl == "tc":  # shared-memory bound: the K/V ring of ls_decode_tc
            per_sm = min(2 if self.D >= 128 else 4, (228 * 1024) // (self._tc_smem() + 4096))
        else:  # register bound (kernels/decode.cu MIN_BLOCKS)
            per_sm = 3 if self.gq <= 4 and self.dtype != torch.float32 else 2
        return max(1, per_sm) * self.num_sms

    def _tc_smem(self) -> int:
        """Dynamic shared memory of ls_decode_tc: 3 stages of 64-token K and V tiles."""
        return 3 * 2 * 64 * (self.D + 8) * 2

    def _units(self, st: _Step, nd: int, selects: bool) -> _Units:
        key = (nd, selects, self.decode_impl)
        if key in st.units:
            return st.units[key]
        h = st.host
        hkv, nqs = self.hkv, self.nqs
        dyn = (h["dyn"] != 0) & selects
        if st.bounds is None:
            n_sel = (h["kk"] - 1) * (self.group if self.qmode else 1)
            e_dense = np.where(dyn, n_sel + h["npages"] - h["nsel"] + 1, h["npages"])  # [nb] upper bounds
            e_ring = h["nring"]
        else:  # a CUDA-graph step: bounds shared by every step of its key
            e_dense = np.where(dyn, st.bounds[0], st.bounds[1])
            e_ring = np.full(st.nb, st.bounds[2])
        e = np.empty((st.nb, hkv, nqs), dtype=np.int64)
        e[:, :nd, :] = e_dense[:, None, None]
        e[:, nd:, :] = e_ring[:, None, None]
        e = np.maximum(e.reshape(-1), 1)
        target = self.decode_ctas()
        chunk = int(min(MAX_CHUNK, max(self.min_chunk, math.ceil(e.sum() / target))))
        nsplit = -(-e // chunk)
        while chunk < MAX_CHUNK and nsplit.sum() > target:  # ceilings overshoot: grow
            chunk += 1
            nsplit = -(-e // chunk)
        W, U = e.size, int(nsplit.sum())
        work_start = np.zeros(W + 1, dtype=np.int32)
        np.cumsum(nsplit, out=work_start[1:])
        work = np.repeat(np.arange(W, dtype=np.int32), nsplit)
        split = np.arange(U, dtype=np.int32) - np.repeat(work_start[:-1], nsplit)
        units = np.stack([work, split], axis=1).astype(np.int32)
        dev = torch.from_numpy(np.concatenate([units.reshape(-1), work_start])).to(self.device)
        direct = bool(nsplit.max() == 1)
        part_o = part_lse = None
        if not direct:
            part_o = torch.empty((U, self.gq, self.D), dtype=torch.float32, device=self.device)
            part_lse = torch.empty((U, self.gq), dtype=torch.float32, device=self.device)
        res = _Units(U, W, chunk, direct, dev[: 2 * U].view(U, 2), dev[2 * U:], part_o, part_lse)
        st.units[key] = res
        return res

    # -- run ------------------------------------------------------------------------------------
    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Attention of one layer. q: [T, H_q, D], k, v: [T, H_kv, D] -> [T, H_q, D]."""
        out = torch.empty_like(q)
        self.attend(layer, q, k, v, plan, out)
        return out

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan,
               out: torch.Tensor) -> None:
        """:meth:`run` into a given output ``out`` [T, H_q, D] (every row of the step is written)."""
        hq = self.model.num_heads
        _check_rows(q, self.dtype, hq, self.D, "q", self.device)
        _check_rows(k, self.dtype, self.hkv, self.D, "k", self.device)
        _check_rows(v, self.dtype, self.hkv, self.D, "v", self.device)
        _check_rows(out, self.dtype, hq, self.D, "out", self.device)
        st = self._tables(plan)
        self.write(layer, k, v, plan.dense_write_decode, plan.stream_write_decode)
        early = bool(st.cont) and self.one_call  # prefill_cont reads the chunks' dense keys from the pool
        if early:
            self.write(layer, k, v, plan.dense_write_prefill, self._no_writes)
        if st.nb:
            self.select_stage(layer, q, st)
            self.decode(layer, q, out, st)
        if st.fast:
            self.prefill(layer, q, k, v, out, st)
        if st.cont:
            self.prefill_cont(layer, q, k, v, out, st)
        for sp in st.slow:
            sl = slice(sp.t0, sp.t1)
            out[sl] = self._ref._prefill(layer, sp, q[sl], k[sl], v[sl])
        # streaming keys after attention: a chunk's writes may reuse ring slots its queries read
        self.write(layer, k, v, self._no_writes if early else plan.dense_write_prefill, plan.stream_write_prefill)

    # -- stages ---------------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, dense_w, stream_w) -> None:
        """Append K/V rows (and fold key statistics). dense_w, stream_w: (token, page, offset) long [W]."""
        from lserve.kernels.loader import i32, i64, launch, ptr

        nd, hs = self.cache.n_dense[layer], self.cache.n_stream[layer]
        d_tok, d_page, d_off = dense_w
        s_tok, s_page, s_off = stream_w
        nwd, nws = (d_tok.numel() if nd else 0), (s_tok.numel() if hs else 0)
        items = nwd * nd + nws * hs
        if items == 0:
            return
        for t in (d_tok, d_page, d_off, s_tok, s_page, s_off):
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise TypeError("write tables must be contiguous int64 tensors")
        dp, sp_, stats = self.cache.dense[layer], self.cache.stream[layer], self.cache.stats[layer]
        kern = self._kernel("kv_write", "ls_kv_write", self.kv_quant)
        args = (ptr(k), i64(k.stride(0)), ptr(v), i64(v.stride(0)),
                ptr(d_tok), ptr(d_page), ptr(d_off), i32(nwd), i32(nd),
                ptr(dp.k), ptr(dp.v), ptr(dp.k_scale), ptr(dp.v_scale), ptr(dp.k_zero), ptr(dp.v_zero),
                ptr(stats.kmax), ptr(stats.kmin), i32(stats.g), i32(stats.logical_page_size),
                ptr(s_tok), ptr(s_page), ptr(s_off), i32(nws), i32(hs),
                ptr(sp_.k), ptr(sp_.v), ptr(sp_.k_scale), ptr(sp_.v_scale), ptr(sp_.k_zero), ptr(sp_.v_zero),
                i32(self.cache.page_size))
        launch(kern, (-(-items // 4),), (128,), args, pdl=self.pdl)

    def select_stage(self, layer: int, q: torch.Tensor, st: _Step) -> None:
        """The selector's part of a decode step: run it for the sequences that select now (a step
        that only reuses launches nothing; the decode kernel reads the stored selection)."""
        if not (st.n_dynamic and self.layer_selects(layer)):
            return
        if st.n_sel_rows:
            self.select(layer, q, st)
        stats = getattr(self, "selector_stats", None)  # metrics (AttentionBackend)
        if stats is not None:
            stats.reuses += st.n_dynamic - st.n_sel_rows

    def _scores_cuda(self, q, st: _Step, stats, nd: int, npmax: int, scores: torch.Tensor, only) -> None:
        """Page scores through ``ls_page_scores`` (CUDA cores)."""
        from lserve.kernels.loader import KernelError, i32, i64, launch, ptr

        R = st.n_sel_rows
        kern = self._kernel("selector", "ls_page_scores", "none", self.gq)
        hpc = self.score_hpc or next(c for c in (4, 2, 1) if nd % c == 0)  # heads per CTA
        if nd % hpc:
            raise KernelError(f"score_hpc={hpc} does not divide the {nd} dense heads")
        # Pages per CTA: one wave of ~3 CTAs per SM over all (sequence, head group) rows, a
        # multiple of the CTA's page streams (8 / hpc), at most SCORE_PAGES_MAX.
        nst = 8 // hpc
        ppb = -(-npmax * (nd // hpc) * self.nqs * R // (3 * self.num_sms))
        ppb = min(SCORE_PAGES_MAX, max(2 * nst, -(-ppb // nst) * nst))
        if self.score_ppb:
            ppb = min(SCORE_PAGES_MAX, max(nst, self.score_ppb // nst * nst))
        launch(kern, (-(-npmax // ppb) if only != "topk" else 0, (nd // hpc) * self.nqs, R), (128,),
               (ptr(q), i64(q.stride(0)), ptr(stats.kmax), ptr(stats.kmin), i32(nd), i32(self.g_log),
                ptr(st.meta), i32(st.nb), ptr(st.sel_rows), ptr(st.pages), i32(st.pages.shape[1]),
                ptr(scores), i32(npmax), i32(self.group), i32(self.nqs), i32(int(self.qmode)), i32(ppb),
                i32(hpc)), pdl=self.pdl)

    def _scores_tc(self, q, st: _Step, stats, nd: int, npmax: int, scores: torch.Tensor, only) -> None:
        """Page scores through ``ls_page_scores_tc`` (tensor cores): one dense head per CTA, pages
        per CTA sized for one wave of resident CTAs."""
        from lserve.kernels.loader import i32, i64, launch, ptr

        R = st.n_sel_rows
        smem = 2 * 3 * 64 * (self.D + 8) * 2  # STAGES kmax + kmin tiles of 64 rows
        per_sm = max(1, min(4, (228 * 1024) // (smem + 2048)))
        ppb = -(-npmax * nd * self.nqs * R // (per_sm * self.num_sms))
        ppb = min(SCORE_PAGES_MAX, max(1, self.score_ppb or ppb))
        kern = self._kernel("selector_tc", "ls_page_scores_tc", "none", self.gq)
        launch(kern, (-(-npmax // ppb) if only != "topk" else 0, nd * self.nqs, R), (128,),
               (ptr(q), i64(q.stride(0)), ptr(stats.kmax), ptr(stats.kmin), i32(nd), i32(self.g_log),
                i32(self.g_log.bit_length() - 1), ptr(st.meta), i32(st.nb), ptr(st.sel_rows), ptr(st.pages),
                i32(st.pages.shape[1]), ptr(scores), i32(npmax), i32(self.group), i32(self.nqs),
                i32(int(self.qmode)), i32(ppb)), shared_mem=smem, pdl=self.pdl)

    def select(self, layer: int, q: torch.Tensor, st: _Step, only: str | None = None) -> None:
        """Run the page selector for the decode sequences that select this step.

        ``only`` (``"scores"`` or ``"topk"``) launches one of the two kernels, for benchmarks.
        """
        from lserve.kernels.loader import KernelError, i32, launch, ptr

        t0 = time.perf_counter()
        nd = self.cache.n_dense[layer]
        stats = self.cache.stats[layer]
        R, npmax = st.n_sel_rows, st.max_np_sel
        rows_per_seq = nd * (self.group if self.qmode else self.nqs)
        scores = torch.empty((R, rows_per_seq, npmax), dtype=torch.float32, device=self.device)
        if only == "topk":
            scores = self._scores_buf
        elif only is None:
            self._scores_buf = scores
        if self.score_impl == "tc":
            self._scores_tc(q, st, stats, nd, npmax, scores, only)
        else:
            self._scores_cuda(q, st, stats, nd, npmax, scores, only)
        smem = 2 * 4 * max(npmax - 1, 1)  # keys (then the candidates' physical pages) and bits
        if smem > 227 * 1024:
            raise KernelError(f"page selection over {npmax} pages exceeds the top-k kernel's shared memory")
        kern = self._kernel("selector", "ls_page_topk", "none", self.gq)
        launch(kern, (R if only != "scores" else 0, nd), (TOPK_THREADS,),
               (ptr(scores), i32(npmax), ptr(st.meta), i32(st.nb), ptr(st.sel_rows), i32(nd), i32(self.group),
                i32(self.nqs), i32(int(self.qmode)),
                ptr(self._sel_idx[layer]), ptr(self._sel_mask[layer] if self.qmode else self._sel_mask),
                ptr(self._sel_cnt[layer]), i32(self._sel_idx.shape[2] * self._cap_u), i32(self._cap_u),
                i32(self._sel_cnt.shape[2]), ptr(st.pages), i32(st.pages.shape[1]), ptr(self._sel_page[layer])),
               shared_mem=smem, pdl=self.pdl)
        stats = getattr(self, "selector_stats", None)
        if stats is not None:  # launch time only: nothing here synchronizes
            stats.runs += R
            stats.pages += st.sel_pages * nd * (self.group if self.qmode else 1)
            stats.seconds += time.perf_counter() - t0

    def decode(self, layer: int, q: torch.Tensor, out: torch.Tensor, st: _Step, merge: bool = True) -> None:
        """Decode attention of every decode sequence and KV head of the layer (one launch + merge).

        ``merge=False`` skips the split-K merge (benchmarks: the attention kernel alone).
        """
        from lserve.kernels.loader import f32, i32, i64, launch, ptr

        nd, hs = self.cache.n_dense[layer], self.cache.n_stream[layer]
        selects = self.layer_selects(layer)
        un = self._units(st, nd, selects)
        dp, sp_ = self.cache.dense[layer], self.cache.stream[layer]
        sel_idx = self._sel_idx[layer]
        sel_mask = self._sel_mask[layer] if self.qmode else self._sel_mask
        if self.decode_impl == "tc":
            kern, smem = self._kernel("decode_tc", "ls_decode_tc", "none", self.gq), self._tc_smem()
        else:
            kern, smem = self._kernel("decode", "ls_decode", self.kv_quant, self.gq), 0
        args = (ptr(q), i64(q.stride(0)), ptr(out), i64(out.stride(0)),
                ptr(un.part_o), ptr(un.part_lse), ptr(un.units), i32(un.chunk), i32(int(un.direct)),
                ptr(st.meta), i32(st.nb), ptr(st.pages), i32(st.pages.shape[1]),
                ptr(st.ring_pages), ptr(st.ring_pos), i32(st.ring_pages.shape[1]),
                ptr(sel_idx), ptr(sel_mask), ptr(self._sel_cnt[layer]),
                *((ptr(self._sel_page[layer]),) if self.decode_impl == "tc" else ()),
                i32(sel_idx.shape[1] * sel_idx.shape[2]), i32(sel_idx.shape[2]), i32(self._sel_cnt.shape[2]),
                i32(int(self.qmode)), i32(int(selects)),
                ptr(dp.k), ptr(dp.v), ptr(dp.k_scale), ptr(dp.v_scale), ptr(dp.k_zero), ptr(dp.v_zero), i32(nd),
                ptr(sp_.k), ptr(sp_.v), ptr(sp_.k_scale), ptr(sp_.v_scale), ptr(sp_.k_zero), ptr(sp_.v_zero), i32(hs),
                i32(self.group), i32(self.nqs), i32(self.cache.page_size), i32(self.sp.sink_tokens),
                i32(self.sp.local_tokens), f32(self.qscale))
        if self.decode_impl == "tc":
            N = self.cache.page_size
            args += (i32(N.bit_length() - 1 if N & (N - 1) == 0 else -1),)  # page_shift
        # No top-k ran for this layer in this step: the kernel may read the stored selection
        # before its PDL wait (common.cuh says why that is safe).
        args += (i32(int(not (st.n_dynamic and selects and st.n_sel_rows))),)  # sel_ready
        launch(kern, (un.n_units,), (128,), args, shared_mem=smem, pdl=self.pdl)
        if not un.direct and merge:
            kern = self._kernel("merge", "ls_decode_merge", "none", self.gq)
            launch(kern, (un.n_work, self.gq), (256,),
                   (ptr(un.part_o), ptr(un.part_lse), ptr(un.work_start), ptr(out), i64(out.stride(0)),
                    ptr(st.meta), i32(st.nb), i32(self.hkv), i32(self.group), i32(self.nqs)), pdl=self.pdl)

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                st: _Step) -> None:
        """Prefill (start == 0) of every such sequence: dense heads by SDPA or our kernel, streaming by ours."""
        G, nd = self.group, self.cache.n_dense[layer]
        hs = self.hkv - nd
        if nd and self.prefill_dense == "sdpa":
            for sp in st.fast:
                sl = slice(sp.t0, sp.t1)
                qd = q[sl, : nd * G].transpose(0, 1)  # [Hd*G, n, D]
                kd = k[sl, :nd].transpose(0, 1)  # [Hd, n, D]
                vd = v[sl, :nd].transpose(0, 1)
                if self.flash is not None and sp.step.num_new < CUDNN_MIN_TOKENS:
                    o = causal_attention(qd, kd, vd, self.scale)
                else:
                    o = F.scaled_dot_product_attention(qd[None], kd[None], vd[None], is_causal=True, scale=self.scale,
                                                       enable_gqa=True)[0]
                out[sl, : nd * G] = o.transpose(0, 1)
        elif nd:
            self.prefill_kernel(q, k, v, out, st, head0=0, n_heads=nd * G, streaming=False)
        if hs:
            self.prefill_kernel(q, k, v, out, st, head0=nd * G, n_heads=hs * G, streaming=True)

    def prefill_cont(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     st: _Step) -> None:
        """Chunks whose sequence has cached past (``start > 0``), see :mod:`lserve.attention.chunked`:
        dense heads against the gathered past and themselves (merged by log-sum-exp), streaming
        heads as one virtual batch through ``ls_prefill``."""
        G, nd = self.group, self.cache.n_dense[layer]
        hs = self.hkv - nd
        if nd:
            if st.c_pages_long is None:
                st.c_pages_long = st.c_pages.long()
            for sp, (off, npg) in zip(st.cont, st.c_page_off):
                sl, start = slice(sp.t0, sp.t1), sp.step.start
                pages = st.c_pages_long[off: off + npg]
                qd = q[sl, : nd * G].transpose(0, 1)  # [Hd*G, n, D]
                if self.one_call:  # the chunk's keys are in the pool already (attend)
                    kd, vd = self._dense_keys(layer, pages, start + sp.step.num_new)  # [Hd, start + n, D]
                    o = causal_attention(qd, kd, vd, self.scale)
                else:
                    kp, vp = self._dense_keys(layer, pages, start)  # [Hd, start, D]
                    o = dense_chunk(qd, kp, vp, k[sl, :nd].transpose(0, 1), v[sl, :nd].transpose(0, 1), G, self.scale)
                out[sl, : nd * G] = o.transpose(0, 1)  # o: [Hd*G, n, D]
        if not hs:
            return
        if st.c_long is None:
            st.c_long = tuple(t.long() for t in (st.c_loc, st.c_kmap, st.c_qmap, st.c_src, st.c_dst))
        loc, kmap, qmap, src, dst = st.c_long
        kr, vr = self.cache.stream[layer].read_tokens(loc[0], loc[1])  # [R, Hs, D]
        kv_ = torch.cat((kr, k[:, nd:]), 0).index_select(0, kmap)  # [V, Hs, D]
        vv = torch.cat((vr, v[:, nd:]), 0).index_select(0, kmap)
        qv = q[:, nd * G:].index_select(0, qmap)  # [V, Hs*G, D]
        ov = torch.empty_like(qv)
        self.prefill_kernel(qv, kv_, vv, ov, st, head0=0, n_heads=hs * G, streaming=True,
                            tables=(st.c_tiles, st.c_seqs))
        out[:, nd * G:].index_copy_(0, dst, ov.index_select(0, src))

    def _dense_keys(self, layer: int, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached K, V of the dense heads for positions [0, length) of a sequence whose dense
        pages are ``pages`` (long [>= ceil(length / N)]): two [Hd, length, D]."""
        hd, N = self.cache.n_dense[layer], self.cache.page_size
        pages = pages[: -(-length // N)]
        heads = self._head_rows.get(hd)
        if heads is None:
            heads = self._head_rows[hd] = torch.arange(hd, device=self.device)[:, None]  # [Hd, 1]
        kk, vv = self.cache.dense[layer].gather(pages.expand(hd, -1), heads)  # [Hd, n_pages, N, D]
        return kk.view(hd, -1, self.D)[:, :length], vv.view(hd, -1, self.D)[:, :length]

    def prefill_kernel(self, q, k, v, out, st: _Step, head0: int, n_heads: int, streaming: bool,
                       tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``ls_prefill`` over query heads [head0, head0 + n_heads) of all start == 0 sequences
        (or of the sequences of ``tables``: (tiles [n, 2], seqs [m, 2]) int32)."""
        from lserve.kernels.loader import f32, i32, i64, launch, ptr

        tiles, seqs = tables if tables is not None else (st.tiles, st.seqs)
        kern = self._kernel("prefill", "ls_prefill")
        smem = 2 * 2 * 64 * (self.D + 8) * 2
        launch(kern, (tiles.shape[0], n_heads), (128,),
               (ptr(q), i64(q.stride(0)), ptr(k), i64(k.stride(0)), ptr(v), i64(v.stride(0)),
                ptr(out), i64(out.stride(0)), ptr(tiles), ptr(seqs), i32(head0), i32(self.group),
                i32(int(streaming)), i32(self.sp.sink_tokens), i32(self.sp.local_tokens), f32(self.qscale)),
               shared_mem=smem)
