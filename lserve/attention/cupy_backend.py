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

Host work happens once per step, in :meth:`CupyBackend.plan`, before the first layer:
:mod:`lserve.attention.cupy_plan` builds every int32 table of the step, the split-K unit table
of each (n_dense, selects, budget kind) layer kind included, as one
:class:`~lserve.attention.cupy_plan.CupyStep`; its tables are packed into one buffer and copied
in one transfer, and the step's :class:`~lserve.sparsity.plan.StepPlan` carries the object
(``plan.tables``). The launches of every layer only read it.

CUDA graphs (:mod:`lserve.engine.cuda_graphs`): a decode-only step planned with ``host=True``
gets its tables in capturable form instead: views of one fixed-capacity device buffer
(:attr:`CupyBackend.static_buffer`) that the engine fills before each replay, page and ring
tables padded so that consecutive steps share a graph key, and split-K units planned for
entry-count bounds once per key (:meth:`CupyBackend.graph_units`, at capture). The kernels take
every other count from device memory, so a replay with the same key is exact.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from lserve.attention import paged_prefill as bsp
from lserve.attention.base import AttentionBackend
from lserve.attention.block_sparse_prefill import sparse_prefill
from lserve.attention.chunked import (
    CUDNN_MIN_TOKENS,
    causal_attention,
    causal_impl,
    chunk_grid,
    chunk_impl,
    dense_chunk,
    grid_segments,
    warm_chunk_plans,
)
from lserve.attention.cupy_plan import (
    BudgetView,
    CupyPlanner,
    CupyStep,
    PlanGeometry,
    SplitK,
    decode_query_heads,
    device_units,
)
from lserve.attention.cupy_tier import TierPicks
from lserve.attention.cupy_tier import bulk_copy as tier_bulk_copy
from lserve.attention.cupy_tuning import CupyTuning
from lserve.attention.prefill_cut import fits as cut_fits
from lserve.attention.prefill_cut import mass_cut
from lserve.attention.prefill_estimate import antidiagonal_masses
from lserve.attention.prefill_estimate import fits as estimate_fits
from lserve.attention.torch_backend import TorchBackend
from lserve.kernels.loader import LOG2E, dtype_name
from lserve.kernels.pdl import available as pdl_available
from lserve.sparsity.plan import SeqStep, StepPlan

TOPK_THREADS = 512
# Block-sparse prefill cuts its estimated masses with kernels/prefill_cut.cu (two launches) instead
# of the torch cut (~30 ops): the same lists (tests/gpu/test_prefill_cut_gpu.py), estimate + cut at
# 128k 6.84 -> 6.43 ms a layer on an H100 (benchmarks/bsp_prefill/bsp_prefill_cut_h100.json).
USE_MASS_CUT = True
SCORE_PAGES_MAX = 128  # PPB_MAX in kernels/selector.cu


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
    tuning : CupyTuning
        Launch shapes (``target_ctas``, ``min_chunk``, ``score_ppb``; read-only attributes of the
        same names); :meth:`tune` replaces them.
    prefill_dense : str
        ``"sdpa"`` (default) or ``"kernel"``: what runs the dense heads at prefill.
    score_impl : str
        ``"tc"`` (tensor cores, ``ls_page_scores_tc``; the default for bf16/fp16 caches whose
        page holds 1, 2, 4, 8 or 16 logical pages) or ``"cuda"`` (``ls_page_scores``).
    score_hpc : int or None
        Dense heads per CTA of the CUDA-core page-score kernel (1, 2 or 4; None: the largest that
        divides the layer's dense heads).
    pdl : bool
        Launch the decode-step kernels (cache write, page scores, top-k, decode, merge) as
        programmatic dependents of the kernel before them (``kernels/pdl.py``), so each starts
        while the previous one drains. Default: on where supported (sm_90+), unless the
        environment sets ``LSERVE_PDL=0``.
    table_planner : CupyPlanner
        Builds each step's host tables (:mod:`lserve.attention.cupy_plan`) and holds the
        per-sequence selection slots.
    """

    name = "cupy"
    supports_adaptive_budgets = True
    supports_prefill_sparsity = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from lserve.kernels.loader import KernelError

        #: The host KV tier (None: off); the kernels then read dense pages through its device table.
        self.tier = self.cache.host_tier
        if self.tier is not None and not self.tier.mirror:
            raise KernelError("the host KV tier on the cupy backend needs its pools in mapped host memory "
                              "(KVCache(host_device='mapped'))")
        if self.tier is not None:  # the tier's page moves: one kernel a batch, not torch index copies
            self.tier.use_bulk_copy(tier_bulk_copy)
        pool = self._dense_pool(0) if self.cache.dense[0].num_heads else self.cache.stream[0]
        self.device = pool.k.device
        self.dtype = pool.dtype
        self._check_device()
        if dtype_name(self.dtype) is None:
            raise KernelError(f"unsupported cache dtype {self.dtype}")
        self.D = self.model.head_dim
        if self.D not in (64, 128, 256):
            raise KernelError(f"the cupy backend supports head_dim 64, 128, 256 (got {self.D})")
        if self.cache.page_size % 4:
            raise KernelError(f"the cupy backend needs a page size that is a multiple of 4 (got {self.cache.page_size})")
        if self.group > 32:
            raise KernelError(f"GQA groups above 32 query heads are not supported (got {self.group})")
        self.dt_name = dtype_name(self.dtype)
        self.kv_quant = self.cache.cfg.kv_quant
        self.gq = decode_query_heads(self.group)
        self.nqs = self.group // self.gq
        self.qmode = self.sp.select_mode == "query"
        self.hkv = self.model.num_kv_heads
        self.g_log = self.cache.cfg.pages_per_logical
        self.num_sms = self._num_sms()
        # Tensor-core decode for 16-bit unquantized pools; CUDA cores (dequantize on load) else.
        self.decode_impl = "tc" if self.dtype != torch.float32 and self.kv_quant == "none" else "cuda"
        self.tuning = CupyTuning()  # launch shapes (target_ctas, min_chunk, score_ppb): tune() changes them
        self.prefill_dense = "sdpa"
        tc_scores = self.dtype != torch.float32 and self.g_log in (1, 2, 4, 8, 16)
        self.score_impl = "tc" if tc_scores else "cuda"
        self.score_hpc: int | None = None  # dense heads per page-score CTA (None: 4, 2 or 1)
        self.pdl = os.environ.get("LSERVE_PDL", "1") != "0" and pdl_available(torch.cuda.get_device_capability(self.device))
        self.qscale = self.scale * LOG2E
        # The oracle's code serves fp32 prefill (and gathers the dense past of later chunks).
        self._ref = TorchBackend(self.model, self.sp, self.cache)
        # Host tables of each step (and the per-sequence slots / last-selection page counts).
        self.table_planner = CupyPlanner(PlanGeometry.of(self, self.gq, self.dtype != torch.float32))
        # Plan-time fetches of the tier's page cache (the picks of earlier steps)
        self._tier_picks = (TierPicks(self.tier, self.table_planner.geometry.layer_kinds, self.sp.reuse_interval)
                            if self.tier else None)
        # Budget kind of each layer (0: the mean budget; j: adaptive ratio j of the geometry).
        self.budget_kind = tuple(k for _, _, k in self.table_planner.geometry.layer_kinds)
        # Selection state (logical page indices) per (layer, slot, dense head).
        self._hd_max = max(self.cache.n_dense) if self.cache.n_dense else 0
        self._sel_idx = self._sel_mask = self._sel_cnt = None
        self._sel_page: torch.Tensor | None = None  # the physical pages of _sel_idx (decode_tc reads these)
        #: Per layer, the tier's staging area as ls_stage_picks addresses it ([3, tensors] int64 on
        #: the device: host base, resident base, page bytes); None: no staging (no tier, no area).
        self._stage_bases = self._stage_tables()
        self._staged_parts: torch.Tensor | None = None  # the staging kernel's count of parts, per layer
        if self._stage_bases is not None:  # (host_kv stats read it through the tier)
            self._staged_parts = torch.zeros(self.model.num_layers, dtype=torch.int64, device=self.device)
            self.tier.count_staged_by(self._staged_parts)
        self._sel_stage: torch.Tensor | None = None  # like _sel_idx: each pick's staged slot, or -1
        self._cap_slots = 0
        self._cap_u = 0
        self._static: torch.Tensor | None = None  # int32 tables of CUDA-graph steps
        self._static_units: dict = {}  # step key -> (host unit tables, {(nd, selects, budget kind, impl): DecodeUnits})
        self.static_generation = 0  # bumped when a buffer graphs point into is reallocated
        self._scores_buf: torch.Tensor | None = None  # last page-score buffer (benchmarks time top-k alone)
        self._kernel_overrides: dict = {}  # family -> (module, entry points or None): override_kernels
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        self._no_writes = (empty, empty, empty)
        # Chunks with cached past: dense heads in one flash call over the whole sequence, their
        # keys written first (exact only unquantized); else past and chunk merged by LSE.
        self.flash = causal_impl(self.device, self.dtype, self.D) if self.dtype != torch.float32 else None
        self.one_call = self.flash is not None and self.kv_quant == "none"
        # block lists go to the bsp kernel where its cost model says it is faster (None: never)
        cc = torch.cuda.get_device_capability(self.device) if torch.device(self.device).type == "cuda" else (0, 0)
        self.bsp_shape = bsp.default_shape(self.D, cc)
        self.bsp_cost = (bsp.PathCost(kernel_rate=bsp.MEASURED_RATE[self.bsp_shape.impl])
                         if bsp.supported(self.dtype, self.D) else None)
        #: Dense heads of chunks with cached past through the paged prefill kernel, every causal
        #: block, in one launch per layer for all of a step's chunks (bsp.PAGED_DENSE_CHUNKS; prompts
        #: up to bsp.PAGED_CHUNKS_MAX_PROMPT tokens, :meth:`paged_prompt`): no gathered copy of the
        #: past, no LSE merge, no grid. Needs the chunks' keys in the pool before attention
        #: (one_call) and pages the kernel addresses directly (no host tier).
        self.paged_chunks = (bsp.PAGED_DENSE_CHUNKS and self.bsp_cost is not None and self.bsp_shape.impl == bsp.V5
                             and self.one_call and self.tier is None)
        # Chunks of longer prompts on this grid run cuDNN (chunked.chunk_impl); the engine aligns them.
        self.chunk_grid = chunk_grid(self.device, self.dtype, self.D)
        if self.chunk_grid % self.cache.page_size:  # the past's grid pieces are gathered by whole pages
            self.chunk_grid = 0
        #: Dense-head attention calls of chunks with cached past, by kernel ("paged": the paged
        #: prefill kernel, a call per chunk; "cudnn", "flash", "merge": gathered), and of block lists
        #: ("bsp": the paged_prefill kernel, "gathered": sparse_prefill).
        self.chunk_kernels: Counter = Counter()

    def paged_prompt(self, prompt_tokens: int) -> bool:
        """Whether the chunks of a prompt of ``prompt_tokens`` tokens (0: unknown) run the paged
        prefill kernel (:attr:`paged_chunks`)."""
        return self.paged_chunks and 0 < prompt_tokens <= bsp.PAGED_CHUNKS_MAX_PROMPT

    def chunk_align(self, prompt_tokens: int) -> int:
        """:data:`~lserve.attention.chunked.CUDNN_CHUNK_GRID` for prompts whose later chunks reach
        cuDNN's length (:func:`~lserve.attention.chunked.chunk_impl`) and do not run the paged
        kernel (:meth:`paged_prompt`: no grid), else 0."""
        if self.paged_prompt(prompt_tokens):
            return 0
        return self.chunk_grid if prompt_tokens >= CUDNN_MIN_TOKENS else 0

    def warm_up(self, max_len: int, max_chunk: int) -> int:
        """The paged prefill kernel where it runs chunks (:attr:`paged_chunks`; one shape), and cuDNN's
        plans for every grid-aligned chunk shape (:func:`~lserve.attention.chunked.warm_chunk_plans`)
        where prompts up to ``max_len`` reach the grid."""
        n = 0
        if self.paged_chunks:
            bsp.kernel(self.bsp_shape, self.dtype, self.D)
            n = 1
        if not self.chunk_grid or self.paged_prompt(max_len):  # no prompt reaches the grid
            return n
        return n + warm_chunk_plans(self.device, self.dtype, self.D, self.group, self.cache.n_dense, max_len, max_chunk)

    def _check_device(self) -> None:
        from lserve.kernels.loader import KernelError

        if self.device.type != "cuda":
            raise KernelError("the cupy backend needs the cache on a CUDA device")

    def _num_sms(self) -> int:
        return torch.cuda.get_device_properties(self.device).multi_processor_count

    # -- kernels --------------------------------------------------------------------------------
    def tune(self, **changes) -> CupyTuning:
        """Change launch shapes (fields of :class:`CupyTuning`), validated; returns the new tuning.

        For benchmarks and probes; plans made before keep their units until re-planned
        (:meth:`replan_units`)."""
        self.tuning = replace(self.tuning, **changes)
        return self.tuning

    @property
    def target_ctas(self) -> int | None:
        """Most decode units per launch (None: one wave of resident CTAs); see :class:`CupyTuning`."""
        return self.tuning.target_ctas

    @property
    def min_chunk(self) -> int:
        """Fewest table entries per decode unit; see :class:`CupyTuning`."""
        return self.tuning.min_chunk

    @property
    def score_ppb(self) -> int | None:
        """Physical pages per page-score CTA (None: one wave); see :class:`CupyTuning`."""
        return self.tuning.score_ppb

    def override_kernels(self, family: str, module, names=None) -> None:
        """Take ``family``'s kernels from ``module`` instead of the shipped sources.

        The one way tools swap kernels (``scripts/probes/kernel_edits.py`` compiles edited sources for
        timing experiments); the serving path never calls it.

        Parameters
        ----------
        family : str
            A kernel family of :data:`lserve.kernels.loader.FAMILIES` (e.g. ``"decode_tc"``).
        module : cupy.RawModule
            Compiled for this backend's variant (dtype, head dim, ``gq``).
        names : iterable of str, optional
            Only these entry points; the family's other kernels stay the shipped ones.

        Raises
        ------
        ValueError
            For an unknown family or entry point.
        """
        from lserve.kernels.loader import FAMILIES

        if family not in FAMILIES:
            raise ValueError(f"unknown kernel family {family!r}; known: {sorted(FAMILIES)}")
        names = None if names is None else frozenset(names)
        if names is not None and not names <= set(FAMILIES[family][1]):
            raise ValueError(f"{family} has no kernel {sorted(names - set(FAMILIES[family][1]))}")
        self._kernel_overrides[family] = (module, names)

    def clear_kernel_overrides(self) -> None:
        """Back to the shipped kernels after :meth:`override_kernels`."""
        self._kernel_overrides.clear()

    def _kernel(self, family: str, name: str, quant: str = "none", gq: int = 1):
        from lserve.kernels.loader import TIER_FAMILIES, Variant, get_kernel

        ov = self._kernel_overrides.get(family)
        if ov is not None and (ov[1] is None or name in ov[1]):
            return ov[0].get_function(name)
        tier = self.tier is not None and family in TIER_FAMILIES  # dense pages through the tier's table
        return get_kernel(Variant(family, self.dt_name, self.D, quant, gq, tier=tier), name)

    def _dense_pool(self, layer: int):
        """The device pool the kernels address dense pages in (with the tier: its resident slots)."""
        pool = self.cache.dense[layer]
        return pool.resident if self.tier is not None else pool

    def _stage_tables(self) -> list[torch.Tensor] | None:
        """The staging area's address tables (:attr:`_stage_bases`), or None where the tier has no
        area or a head's part of a page is not whole 16-byte words (picks are then read in place)."""
        t = self.tier
        if t is None or not t.stage_slots:
            return None
        tables = []
        for layer, nd in enumerate(self.cache.n_dense):
            b = np.ascontiguousarray(t.page_bases(layer))
            if nd and (b[2] % (16 * nd)).any():
                return None
            tables.append(torch.from_numpy(b).to(self.device))
        return tables

    def _tier_arg(self, layer: int):
        """The ``tier`` kernel argument: the layer's ``TierLayer`` on the device, or None (0)."""
        return self.tier.layer_struct(layer) if self.tier is not None else None

    # -- sequence state -------------------------------------------------------------------------
    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.table_planner.release(seq_id)

    def _ensure_state(self, n_slots: int, u_needed: int) -> None:
        """Grow the selection-state buffers to hold ``n_slots`` slots of ``u_needed`` entries."""
        if n_slots <= self._cap_slots and u_needed <= self._cap_u:
            return
        slots = max(n_slots, 2 * self._cap_slots, 8)
        cap_u = max(u_needed, self._cap_u)
        L, H = self.model.num_layers, max(self._hd_max, 1)
        idx = torch.zeros((L, slots, H, cap_u), dtype=torch.int32, device=self.device)
        page = torch.zeros_like(idx)
        stage = torch.full_like(idx, -1) if self._stage_bases is not None else None
        cnt = torch.zeros((L, slots, H), dtype=torch.int32, device=self.device)
        msk = torch.zeros((L, slots, H, cap_u) if self.qmode else (1,), dtype=torch.int32, device=self.device)
        if self._sel_idx is not None:
            s, u = self._cap_slots, self._cap_u
            idx[:, :s, :, :u] = self._sel_idx
            page[:, :s, :, :u] = self._sel_page
            if stage is not None:
                stage[:, :s, :, :u] = self._sel_stage
            cnt[:, :s] = self._sel_cnt
            if self.qmode:
                msk[:, :s, :, :u] = self._sel_mask
        self._sel_idx, self._sel_cnt, self._sel_mask, self._sel_page = idx, cnt, msk, page
        if stage is not None:  # the decode kernels find it through the tier's per-layer struct
            self._sel_stage = stage
            self.tier.set_stage_maps(stage)
        self._cap_slots, self._cap_u = slots, cap_u
        self.static_generation += 1  # captured graphs point at the old buffers
        self._static_units.clear()

    # -- per-step tables ------------------------------------------------------------------------
    def split_k(self) -> SplitK:
        """The split-K settings unit tables are planned with now (:meth:`decode_ctas`,
        :attr:`min_chunk`, :attr:`decode_impl`)."""
        return SplitK(self.decode_ctas(), self.min_chunk, self.decode_impl)

    def plan(self, steps: list[SeqStep], host: bool = False) -> StepPlan:
        """The step's plan with its kernel tables on the device in :attr:`StepPlan.tables`
        (:meth:`_eager_tables`); a ``host`` plan (a decode-only step the engine may replay as a
        CUDA graph) carries them in capturable form instead (:meth:`_graph_tables`; None when the
        step cannot be captured), and :meth:`eager_plan` gives it eager ones if it runs eagerly."""
        if self._tier_picks is not None:  # earlier steps' picks into the resident set, before this step's pins
            self._tier_picks.begin_step(self._sel_page, self._sel_cnt)
        plan = super().plan(steps, host)
        plan.tables = self._graph_tables(plan) if host else self._eager_tables(plan)
        if self._tier_picks is not None and plan.tables is not None:
            self._tier_picks.after_plan(plan.tables)
        return plan

    def eager_plan(self, plan: StepPlan, device) -> StepPlan:
        """A ``host`` plan that is not replayed (first sight of its graph key, past its bounds,
        capture off): its tensors on ``device`` and its eager tables, as any other step's."""
        moved = super().eager_plan(plan, device)
        moved.tables = self._eager_tables(moved)
        if self._tier_picks is not None and plan.tables is None:  # plan() had no tables to note
            self._tier_picks.after_plan(moved.tables)
        return moved

    def _eager_tables(self, plan: StepPlan) -> CupyStep:
        """The tables of ``plan``, planned for this step exactly and uploaded in one transfer."""
        st = self.table_planner.plan(plan, split=self.split_k())
        if st.nb:
            self._ensure_state(st.need_slots, st.need_entries)
        if st.arrays:
            flat = st.pack(units=True)
            st.bind(torch.from_numpy(flat).to(self.device, non_blocking=False), True, self.gq, self.D)
        if st.cont:  # chunks with cached past index with int64, in the layers that have such heads
            if any(self.cache.n_dense):
                st.c_pages_long = st.c_pages.long()
            if any(nd < self.hkv for nd in self.cache.n_dense):
                st.c_long = tuple(t.long() for t in (st.c_loc, st.c_kmap, st.c_qmap, st.c_src, st.c_dst))
        return st

    def _graph_tables(self, plan: StepPlan) -> CupyStep | None:
        """Tables of a decode-only step in a capturable form, or None (run it eagerly).

        Page tables are padded to a bucket of the longest sequence (1/32..1/64 of its length),
        ring tables to the ring's size, and the split-K units are planned for entry-count
        upper bounds, so consecutive steps share a key (``CupyStep.key``), and with it one CUDA
        graph. The tables are views of :attr:`static_buffer`, which the caller fills with
        ``CupyStep.packed`` before the graph (or its capture) runs; their units are those the key
        got at capture (:meth:`graph_units`), if it was captured. :attr:`static_generation` says
        whether the buffers graphs point into are still those of earlier steps.
        """
        if not plan.seqs or any(not s.step.decode for s in plan.seqs):
            return None
        st = self.table_planner.plan(plan, static=True)
        self._ensure_state(st.need_slots, st.need_entries)
        if st.bounds is None:
            return None
        st.packed = st.pack(units=False)
        if self._static is None or self._static.numel() < st.packed.size:
            self._static = torch.empty(max(st.packed.size, 2 * (0 if self._static is None else self._static.numel()),
                                           4096), dtype=torch.int32, device=self.device)
            self.static_generation += 1
        st.bind(self._static, units=False)
        cached = self._static_units.get(st.key)
        if cached is not None:
            st.unit_tables, st.units = cached
        return st

    def graph_units(self, st: CupyStep) -> None:
        """Give the CUDA-graph step ``st`` its key's split-K units (fixed device buffers a graph
        captures), planned for the key's bounds and uploaded the first time the key is captured."""
        if st.key is None:
            raise ValueError("graph_units: the tables are not a CUDA-graph step's (plan it with host=True)")
        if st.nb and not st.units:
            cached = self._static_units.get(st.key)
            if cached is None:
                host = self.table_planner.plan_units(st, self.split_k())
                cached = self._static_units[st.key] = (host, self._upload_units(host))
            st.unit_tables, st.units = cached

    def replan_units(self, st: CupyStep) -> None:
        """Plan and upload ``st``'s split-K units again, for the current :attr:`target_ctas` /
        :attr:`min_chunk` (benchmarks that vary them on fixed tables)."""
        st.unit_tables = self.table_planner.plan_units(st, self.split_k())
        st.units = self._upload_units(st.unit_tables)

    def _upload_units(self, host: dict) -> dict:
        """Unit tables ``{kind: UnitTable}`` on the device (one transfer), with merge buffers."""
        dev = torch.from_numpy(np.concatenate([a for t in host.values() for a in (t.units.reshape(-1), t.work_start)]))
        dev = dev.to(self.device)
        units, o = {}, 0
        for key, t in host.items():
            n = 2 * t.n_units + t.n_work + 1
            units[key] = device_units(t, dev[o: o + n], self.gq, self.D)
            o += n
        return units

    # -- CUDA-graph steps -----------------------------------------------------------------------
    @property
    def static_buffer(self) -> torch.Tensor:
        """The device buffer every CUDA-graph step's tables live in (int32)."""
        return self._static

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
        st = plan.tables
        if not isinstance(st, CupyStep) or (st.nb and not st.units):
            raise ValueError("attend: plan the step with this backend's plan() (a host plan: eager_plan() first; "
                             "a CUDA-graph step's tables run only through DecodeGraphs)")
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
        dp, sp_, stats = self._dense_pool(layer), self.cache.stream[layer], self.cache.stats[layer]
        kern = self._kernel("kv_write", "ls_kv_write", self.kv_quant)
        args = (ptr(k), i64(k.stride(0)), ptr(v), i64(v.stride(0)),
                ptr(d_tok), ptr(d_page), ptr(d_off), i32(nwd), i32(nd),
                ptr(dp.k), ptr(dp.v), ptr(dp.k_scale), ptr(dp.v_scale), ptr(dp.k_zero), ptr(dp.v_zero),
                ptr(stats.kmax), ptr(stats.kmin), i32(stats.g), i32(stats.logical_page_size),
                ptr(s_tok), ptr(s_page), ptr(s_off), i32(nws), i32(hs),
                ptr(sp_.k), ptr(sp_.v), ptr(sp_.k_scale), ptr(sp_.v_scale), ptr(sp_.k_zero), ptr(sp_.v_zero),
                i32(self.cache.page_size), ptr(self._tier_arg(layer)))
        launch(kern, (-(-items // 4),), (128,), args, pdl=self.pdl)

    def select_stage(self, layer: int, q: torch.Tensor, st: CupyStep) -> None:
        """The selector's part of a decode step: run it for the sequences that select now (a step
        that only reuses launches nothing; the decode kernel reads the stored selection)."""
        bv = st.budget(self.budget_kind[layer])
        if not (bv.n_dynamic and self.layer_selects(layer)):
            return
        if bv.n_sel_rows:
            self.select(layer, q, st)
        stats = getattr(self, "selector_stats", None)  # metrics (AttentionBackend)
        if stats is not None:
            stats.reuses += bv.n_dynamic - bv.n_sel_rows

    def _scores_cuda(self, q, st: CupyStep, bv: BudgetView, stats, nd: int, npmax: int, scores: torch.Tensor,
                     only) -> None:
        """Page scores through ``ls_page_scores`` (CUDA cores)."""
        from lserve.kernels.loader import KernelError, i32, i64, launch, ptr

        R = bv.n_sel_rows
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
                ptr(bv.meta), i32(st.nb), ptr(bv.sel_rows), ptr(st.pages), i32(st.pages.shape[1]),
                ptr(scores), i32(npmax), i32(self.group), i32(self.nqs), i32(int(self.qmode)), i32(ppb),
                i32(hpc)), pdl=self.pdl)

    def _scores_tc(self, q, st: CupyStep, bv: BudgetView, stats, nd: int, npmax: int, scores: torch.Tensor,
                   only) -> None:
        """Page scores through ``ls_page_scores_tc`` (tensor cores): one dense head per CTA, pages
        per CTA sized for one wave of resident CTAs."""
        from lserve.kernels.loader import i32, i64, launch, ptr

        R = bv.n_sel_rows
        smem = 2 * 3 * 64 * (self.D + 8) * 2  # STAGES kmax + kmin tiles of 64 rows
        per_sm = max(1, min(4, (228 * 1024) // (smem + 2048)))
        ppb = -(-npmax * nd * self.nqs * R // (per_sm * self.num_sms))
        ppb = min(SCORE_PAGES_MAX, max(1, self.score_ppb or ppb))
        kern = self._kernel("selector_tc", "ls_page_scores_tc", "none", self.gq)
        launch(kern, (-(-npmax // ppb) if only != "topk" else 0, nd * self.nqs, R), (128,),
               (ptr(q), i64(q.stride(0)), ptr(stats.kmax), ptr(stats.kmin), i32(nd), i32(self.g_log),
                i32(self.g_log.bit_length() - 1), ptr(bv.meta), i32(st.nb), ptr(bv.sel_rows), ptr(st.pages),
                i32(st.pages.shape[1]), ptr(scores), i32(npmax), i32(self.group), i32(self.nqs),
                i32(int(self.qmode)), i32(ppb)), shared_mem=smem, pdl=self.pdl)

    def select(self, layer: int, q: torch.Tensor, st: CupyStep, only: str | None = None) -> None:
        """Run the page selector for the decode sequences that select this step.

        Parameters
        ----------
        only : {None, "scores", "topk"}
            Benchmarks only (``lserve bench kernels``, ``scripts/probes/probe_selector.py``): launch the
            page-score kernel alone, or the top-k alone over the scores of the last full call
            with the same step (the other kernel gets an empty grid, so PDL chains stay as
            they are). None (serving): both.

        Raises
        ------
        ValueError
            For another ``only``, or ``"topk"`` before any full call.
        """
        from lserve.kernels.loader import KernelError, i32, launch, ptr

        if only not in (None, "scores", "topk"):
            raise ValueError(f"select(only=...) takes None, 'scores' or 'topk', got {only!r}")
        if only == "topk" and self._scores_buf is None:
            raise ValueError("select(only='topk') times the top-k over a full call's scores: run select() first")

        t0 = time.perf_counter()
        nd = self.cache.n_dense[layer]
        stats = self.cache.stats[layer]
        bv = st.budget(self.budget_kind[layer])
        R, npmax = bv.n_sel_rows, st.max_np_sel
        rows_per_seq = nd * (self.group if self.qmode else self.nqs)
        scores = torch.empty((R, rows_per_seq, npmax), dtype=torch.float32, device=self.device)
        if only == "topk":
            scores = self._scores_buf
        elif only is None:
            self._scores_buf = scores
        if self.score_impl == "tc":
            self._scores_tc(q, st, bv, stats, nd, npmax, scores, only)
        else:
            self._scores_cuda(q, st, bv, stats, nd, npmax, scores, only)
        smem = 2 * 4 * max(npmax - 1, 1)  # keys (then the candidates' physical pages) and bits
        if smem > 227 * 1024:
            raise KernelError(f"page selection over {npmax} pages exceeds the top-k kernel's shared memory")
        kern = self._kernel("selector", "ls_page_topk", "none", self.gq)
        launch(kern, (R if only != "scores" else 0, nd), (TOPK_THREADS,),
               (ptr(scores), i32(npmax), ptr(bv.meta), i32(st.nb), ptr(bv.sel_rows), i32(nd), i32(self.group),
                i32(self.nqs), i32(int(self.qmode)),
                ptr(self._sel_idx[layer]), ptr(self._sel_mask[layer] if self.qmode else self._sel_mask),
                ptr(self._sel_cnt[layer]), i32(self._sel_idx.shape[2] * self._cap_u), i32(self._cap_u),
                i32(self._sel_cnt.shape[2]), ptr(st.pages), i32(st.pages.shape[1]), ptr(self._sel_page[layer])),
               shared_mem=smem, pdl=self.pdl)
        if self._stage_bases is not None and only is None:
            self._stage_picks(layer, st, bv, nd)
        stats = getattr(self, "selector_stats", None)
        if stats is not None:  # launch time only: nothing here synchronizes
            stats.runs += R
            stats.pages += bv.sel_pages * nd * (self.group if self.qmode else 1)
            stats.seconds += time.perf_counter() - t0

    def stage_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The selection's pages, counts and staged slots (``[layers, slots, heads, entries]``,
        ``[layers, slots, heads]``, as ``pages``; -1: not staged), or None without staging or
        before any selection (tests check the staged bytes against the host pool)."""
        if self._sel_stage is None:
            return None
        return self._sel_page, self._sel_cnt, self._sel_stage

    def _stage_picks(self, layer: int, st: CupyStep, bv, nd: int) -> None:
        """After a layer's top-k: copy the head parts of the picks on the host into the tier's
        staging area, once a selection (``kernels/stage.cu``); the decode kernels read them there."""
        from lserve.kernels.loader import i32, launch, ptr

        t, bases = self.tier, self._stage_bases[layer]
        kern = self._kernel("stage", "ls_stage_picks", "none", self.gq)
        launch(kern, (bv.n_sel_rows, nd, self._cap_u), (128,),
               (ptr(bv.meta), i32(st.nb), ptr(bv.sel_rows), i32(nd), ptr(self._sel_page[layer]),
                ptr(self._sel_cnt[layer]), ptr(self._sel_stage[layer]), i32(self._sel_idx.shape[2] * self._cap_u),
                i32(self._cap_u), i32(self._sel_cnt.shape[2]), ptr(self._tier_arg(layer)), ptr(bases),
                i32(bases.shape[1]), i32(t.stage_base), i32(t.stage_slots), i32(t.stage_entries),
                ptr(self._staged_parts[layer])), pdl=self.pdl)

    def decode(self, layer: int, q: torch.Tensor, out: torch.Tensor, st: CupyStep, merge: bool = True) -> None:
        """Decode attention of every decode sequence and KV head of the layer (one launch + merge).

        ``merge=False`` skips the split-K merge (benchmarks: the attention kernel alone).
        """
        from lserve.kernels.decode_args import decode_args
        from lserve.kernels.loader import i32, i64, launch, ptr

        nd, hs = self.cache.n_dense[layer], self.cache.n_stream[layer]
        N = self.cache.page_size
        selects = self.layer_selects(layer)
        kind = self.budget_kind[layer]
        bv = st.budget(kind)
        un = st.units[(nd, selects, kind, self.decode_impl)]
        dp, sp_ = self._dense_pool(layer), self.cache.stream[layer]
        sel_idx = self._sel_idx[layer]
        sel_mask = self._sel_mask[layer] if self.qmode else self._sel_mask
        if self.decode_impl == "tc":
            kern, smem = self._kernel("decode_tc", "ls_decode_tc", "none", self.gq), self._tc_smem()
        else:
            kern, smem = self._kernel("decode", "ls_decode", self.kv_quant, self.gq), 0
        tc = self.decode_impl == "tc"
        args = decode_args(
            self.decode_impl,
            q=q, q_tok_stride=q.stride(0), out=out, out_tok_stride=out.stride(0),
            part_o=un.part_o, part_lse=un.part_lse, units=un.units, chunk=un.chunk, direct=int(un.direct),
            meta=bv.meta, nb=st.nb, pages=st.pages, pages_stride=st.pages.shape[1],
            ring_pages=st.ring_pages, ring_pos=st.ring_pos, ring_stride=st.ring_pages.shape[1],
            sel_idx=sel_idx, sel_mask=sel_mask, sel_cnt=self._sel_cnt[layer],
            **({"sel_page": self._sel_page[layer]} if tc else {}),
            sel_slot_stride=sel_idx.shape[1] * sel_idx.shape[2], sel_head_stride=sel_idx.shape[2],
            cnt_slot_stride=self._sel_cnt.shape[2], qmode=int(self.qmode), selects=int(selects),
            dk=dp.k, dv=dp.v, dks=dp.k_scale, dvs=dp.v_scale, dkz=dp.k_zero, dvz=dp.v_zero, hd=nd,
            sk=sp_.k, sv=sp_.v, sks=sp_.k_scale, svs=sp_.v_scale, skz=sp_.k_zero, svz=sp_.v_zero, hs=hs,
            group=self.group, nqs=self.nqs, page_size=self.cache.page_size, sink=self.sp.sink_tokens,
            local=self.sp.local_tokens, qscale=self.qscale,
            # page_shift: log2 of a power-of-two page size, else -1 (the kernel divides)
            **({"page_shift": N.bit_length() - 1 if N & (N - 1) == 0 else -1} if tc else {}),
            # No top-k ran for this layer in this step: the kernel may read the stored selection
            # before its PDL wait (common.cuh says why that is safe).
            sel_ready=int(not (bv.n_dynamic and selects and bv.n_sel_rows)), tier=self._tier_arg(layer))
        launch(kern, (un.n_units,), (128,), args, shared_mem=smem, pdl=self.pdl)
        if not un.direct and merge:
            kern = self._kernel("merge", "ls_decode_merge", "none", self.gq)
            launch(kern, (un.n_work, self.gq), (256,),
                   (ptr(un.part_o), ptr(un.part_lse), ptr(un.work_start), ptr(out), i64(out.stride(0)),
                    ptr(st.meta), i32(st.nb), i32(self.hkv), i32(self.group), i32(self.nqs)), pdl=self.pdl)

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                st: CupyStep) -> None:
        """Prefill (start == 0) of every such sequence: dense heads by SDPA or our kernel, streaming by ours."""
        G, nd = self.group, self.cache.n_dense[layer]
        hs = self.hkv - nd
        if nd and self.prefill_dense == "sdpa":
            for sp in st.fast:
                sl = slice(sp.t0, sp.t1)
                qd = q[sl, : nd * G].transpose(0, 1)  # [Hd*G, n, D]
                kd = k[sl, :nd].transpose(0, 1)  # [Hd, n, D]
                vd = v[sl, :nd].transpose(0, 1)
                blocks = self.sparse_prefill_blocks(sp, layer, qd, kd)
                if blocks is not None:  # dense heads read the step's rows
                    self.block_sparse(sp, blocks, q, k, v, out, qd, kd, vd)
                    continue
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

    def estimate_masses(self, q, k, start, block, scale, estimator, stride, q_block):
        """The antidiagonal estimate in one GEMM + one kernel per group of rows
        (:func:`lserve.attention.prefill_estimate.antidiagonal_masses`); other estimators: torch."""
        if estimator == "antidiagonal" and q.is_cuda and estimate_fits(k.shape[1], block):
            return antidiagonal_masses(q, k, start, block, q_block or block, scale, stride)
        return super().estimate_masses(q, k, start, block, scale, estimator, stride, q_block)

    def cut_blocks(self, mass, group, tau, start, length, block, q_block, dense_from):
        """The cut in two kernels (:func:`lserve.attention.prefill_cut.mass_cut`) where
        :data:`USE_MASS_CUT` and the rows' tiles fit its shared memory; else torch."""
        if USE_MASS_CUT and mass.is_cuda and mass.dtype == torch.float32 and cut_fits(length, block):
            return mass_cut(mass, group, tau, start, length, block, q_block, dense_from)
        return super().cut_blocks(mass, group, tau, start, length, block, q_block, dense_from)

    def bsp_faster(self, blocks) -> bool:
        """Whether :mod:`lserve.attention.paged_prefill`'s kernel runs this block list faster than
        the gathered-cuDNN path (:attr:`bsp_cost`)."""
        return (self.bsp_cost is not None and blocks.block == bsp.BN
                and self.bsp_cost.kernel_faster(blocks.attention_flops(self.group, self.D), blocks.n_rows))

    def block_sparse(self, sp, blocks, q, k, v, out, qd, kd, vd, pool=None, pages=None) -> None:
        """A chunk's dense heads over their block list, on the faster path (:meth:`bsp_faster`),
        counted in :attr:`chunk_kernels`. The kernel reads the step's rows of a chunk without
        cached past, else the dense ``pool`` through the sequence's ``pages`` (None: it cannot, the
        chunk's keys are not there); the gathered path takes qd/kd/vd ([H, L, D] views)."""
        G, nd, start = self.group, kd.shape[0], sp.step.start
        if (start == 0 or pool is not None) and self.bsp_faster(blocks):
            self.chunk_kernels["bsp"] += 1
            p = bsp.plan([bsp.PrefillSeq(sp.t0, start, sp.step.num_new, 0, blocks)], G, nd, self.device,
                         shape=self.bsp_shape)
            bsp.run(q, k, v, out, p, nd, 0, nd, self.scale, pool=None if start == 0 else (pool.k, pool.v),
                    pages=None if start == 0 else pages)
            return
        self.chunk_kernels["gathered"] += 1
        out[sp.t0: sp.t1, : nd * G] = sparse_prefill(qd, kd, vd, blocks, self.scale).transpose(0, 1)

    def prefill_cont(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     st: CupyStep) -> None:
        """Chunks whose sequence has cached past (``start > 0``), see :mod:`lserve.attention.chunked`:
        dense heads against the gathered past and themselves (cuDNN on the chunk grid, else flash;
        :attr:`chunk_kernels` counts which), streaming heads as one virtual batch through ``ls_prefill``."""
        G, nd = self.group, self.cache.n_dense[layer]
        hs = self.hkv - nd
        if nd:
            paged = []  # chunks whose dense heads the paged kernel runs, in one launch below
            for j, (sp, (off, npg)) in enumerate(zip(st.cont, st.c_page_off)):
                sl, start = slice(sp.t0, sp.t1), sp.step.start
                pages = st.c_pages_long[off: off + npg]
                ids = sp.step.dense_pages  # the same ids on the host: the host tier stages its past from them
                qd = q[sl, : nd * G].transpose(0, 1)  # [Hd*G, n, D]
                if self.prefill_tau(sp, layer):
                    if self.one_call:  # the chunk's keys are in the pool already (attend)
                        kd, vd = self.cache.dense[layer].sequence_kv(pages, start + sp.step.num_new, ids)
                    else:
                        kp, vp = self.cache.dense[layer].sequence_kv(pages, start, ids)  # [Hd, start, D]
                        kd = torch.cat((kp, k[sl, :nd].transpose(0, 1)), 1)  # [Hd, start + n, D]
                        vd = torch.cat((vp, v[sl, :nd].transpose(0, 1)), 1)
                    blocks = self.sparse_prefill_blocks(sp, layer, qd, kd)
                    # the kernel reads past and chunk from the pool, where one_call put the chunk
                    # (the paged kernel addresses the pool by page: not through the host tier's table)
                    pool = self.cache.dense[layer] if self.one_call and self.tier is None else None
                    self.block_sparse(sp, blocks, q, k, v, out, qd, kd, vd, pool, st.c_pages[off: off + npg])
                    continue
                if self.paged_prompt(sp.step.prefill_end):
                    paged.append(j)
                    continue
                # cuDNN on the chunk grid (past and chunk merged by LSE: its plans repeat there),
                # else one flash call (the chunk's keys are in the pool already), else the merge path
                impl = chunk_impl(self.device, self.dtype, self.D, start, sp.step.num_new) if self.chunk_grid else None
                if impl is None and self.one_call:
                    kd, vd = self.cache.dense[layer].sequence_kv(pages, start + sp.step.num_new, ids)  # [Hd, start + n, D]
                    o = causal_attention(qd, kd, vd, self.scale)
                else:
                    if impl is not None:  # the past in grid pieces, each gathered alone: shapes and strides repeat
                        N, pool = self.cache.page_size, self.cache.dense[layer]
                        past = [pool.sequence_kv(pages[a // N:], b - a, ids[a // N:])
                                for a, b in grid_segments(start, self.chunk_grid)]
                        kp, vp = [p[0] for p in past], [p[1] for p in past]  # [Hd, len_i, D] each
                    else:
                        kp, vp = self.cache.dense[layer].sequence_kv(pages, start, ids)  # [Hd, start, D]
                    o = dense_chunk(qd, kp, vp, k[sl, :nd].transpose(0, 1), v[sl, :nd].transpose(0, 1), G,
                                    self.scale, impl)
                self.chunk_kernels[impl or ("flash" if self.one_call else "merge")] += 1
                out[sl, : nd * G] = o.transpose(0, 1)  # o: [Hd*G, n, D]
            if paged:
                self.paged_dense_chunks(layer, q, k, v, out, st, tuple(paged))
        if not hs:
            return
        loc, kmap, qmap, src, dst = st.c_long
        kr, vr = self.cache.stream[layer].read_tokens(loc[0], loc[1])  # [R, Hs, D]
        kv_ = torch.cat((kr, k[:, nd:]), 0).index_select(0, kmap)  # [V, Hs, D]
        vv = torch.cat((vr, v[:, nd:]), 0).index_select(0, kmap)
        qv = q[:, nd * G:].index_select(0, qmap)  # [V, Hs*G, D]
        ov = torch.empty_like(qv)
        self.prefill_kernel(qv, kv_, vv, ov, st, head0=0, n_heads=hs * G, streaming=True,
                            tables=(st.c_tiles, st.c_seqs))
        out[:, nd * G:].index_copy_(0, dst, ov.index_select(0, src))

    def paged_dense_chunks(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           st: CupyStep, chunks: tuple[int, ...]) -> None:
        """Dense heads of the ``cont`` chunks ``chunks`` (indices into ``st.cont``) in one launch of
        the paged prefill kernel over every causal block, past and chunk read from the pool (the
        chunks' keys are written there first: ``one_call``). The tables are built once a step for
        each set of chunks (layers that run block lists for some chunks launch another set)."""
        nd = self.cache.n_dense[layer]
        p = st.paged_plans.get(chunks)
        if p is None:
            seqs = [bsp.PrefillSeq(st.cont[j].t0, st.cont[j].step.start, st.cont[j].step.num_new,
                                    int(st.c_page_off[j][0]))
                    for j in chunks]
            p = st.paged_plans[chunks] = bsp.plan(seqs, self.group, nd, self.device, shape=self.bsp_shape)
        pool = self.cache.dense[layer]
        bsp.run(q, k, v, out, p, nd, 0, nd, self.scale, pool=(pool.k, pool.v), pages=st.c_pages)
        self.chunk_kernels["paged"] += len(chunks)

    def prefill_kernel(self, q, k, v, out, st: CupyStep, head0: int, n_heads: int, streaming: bool,
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
