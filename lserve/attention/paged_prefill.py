"""Unified block-sparse prefill over the paged KV cache (``kernels/bsp_prefill.cu``).

One launch computes the prefill attention of every listed sequence for a range of KV heads:
dense heads over their kept key blocks (a :class:`~lserve.sparsity.prefill_blocks.PrefillBlocks`
per sequence; none = every causal block) read straight from the paged pool, streaming heads over
their sink and local blocks read from the step's own K/V rows. The GQA group is folded into the
query tile, so each K/V block read serves the whole group. Chunked prefill works for dense heads:
the chunk's keys must be in the pool before :func:`run` (streaming heads need ``start == 0``).

:func:`plan` builds a step's tables on the host (tiles, sequences, block rows); :func:`run`
launches. :func:`reference` is the same function in plain torch (float32 softmax), the oracle of
the GPU tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lserve.cache.host_memory import upload
from lserve.sparsity.prefill_blocks import PrefillBlocks

BN = 64  # key block of the kernels; block lists must use the same block
# the warp-specialized kernel's impls -> (LS_BSP_SWIZZLE, LS_BSP_PINGPONG): K/V in the 128-byte
# swizzle or v2's no-swizzle layout; the consumer warpgroups taking turns at the tensor cores or not
WS_IMPLS = {"ws": (1, 0), "wsp": (1, 1), "wsi": (0, 0)}
# v4 (``kernels/bsp_prefill_ws4.cu``): 128 keys (two list blocks) per pipeline step, Q in shared memory
V4 = "v4"
V4_STAGES = (2, 3)  # a stage holds 128 keys of K and of V (64 KiB): three fill the 227 KiB a CTA may use
# v5 (``kernels/bsp_prefill_v5.cu``): v3 ("ws") with the pool's K/V blocks loaded by TMA
V5 = "v5"
# True: dense chunks with cached past of prompts up to PAGED_CHUNKS_MAX_PROMPT tokens run this
# kernel over every causal block, K/V read from the pool, where the kernel is v5 (0.87-0.99x cuDNN
# every block kept), instead of gathering the past for cuDNN in grid pieces merged by LSE or for one
# flash call (``CupyBackend.paged_chunks``). Measured served (probe_served_prefill_paged_h100.json,
# TTFT of a lone prompt in served steps): 3% faster at 32k, 0.8% slower at 128k; longer prompts keep
# the cuDNN grid. The bound between is not measured: 64k splits the two points.
PAGED_DENSE_CHUNKS = True
PAGED_CHUNKS_MAX_PROMPT = 65536
# timing studies of "ws" (LS_BSP_ABLATE in kernels/bsp_prefill_ws.cu): the part each leaves out.
# Their outputs are wrong by design: the bench times them beside the full kernel, nothing else runs them.
ABLATIONS = {1: "noload", 2: "nosoftmax", 3: "nopv", 4: "noexp"}


@dataclass(frozen=True)
class TileShape:
    """Which kernel runs a launch and with what CTA shape.

    ``impl`` "mma": ``kernels/bsp_prefill.cu`` (mma.sync; any sm_80+ GPU), ``mt`` 16-row m-tiles
    per warp; "wg": ``kernels/bsp_prefill_wg.cu`` (Hopper warpgroup MMA, sm_90a), ``warps / 4``
    warpgroups of 64 rows (``mt`` 1), head dim 128 only (at 64 it failed parity on the H200, and it
    is not faster than "mma" at 128: ``benchmarks/bsp_prefill/bsp_prefill_notes.md``), a tuning sandbox;
    "ws" / "wsi": ``kernels/bsp_prefill_ws.cu`` (sm_90a, head dim 128 only), warp-specialized: a
    producer warpgroup fills a ``stages``-deep K/V ring, ``warps / 4`` = 2 consumer warpgroups of 64
    rows overlap the softmax of one block with the P V GEMM of the previous; "ws" stores K/V with the
    128-byte swizzle, "wsi" in v2's no-swizzle layout; "wsp" is "ws" with the two consumer warpgroups
    taking turns at issuing their GEMMs (FA3's ping-pong). On the H200 "ws" runs 249-262 TF/s on
    computed tiles against "mma"'s 217-223 (same call, ``bsp_prefill_ws_h200.json``), the default for
    head dim 128 on sm_90 before "v5". "v4": ``kernels/bsp_prefill_ws4.cu`` (sm_90a, head
    dim 128), the same producer and two consumer warpgroups over 128 keys (two list blocks) per step,
    Q in shared memory (S by SS-wgmma), K and V in separate ``stages``-deep rings (2 or 3):
    13% slower than "ws" on the H200 (``bsp_prefill_v4_h200.json``), a sandbox variant. "v5":
    ``kernels/bsp_prefill_v5.cu`` (sm_90a, head dim 128), "ws" with the producer's pool K/V loads
    done by TMA (one thread, tensor maps from :mod:`lserve.kernels.tensor_map`; ``stages`` 2-4):
    552-592 TF/s every block kept on the H200, 0.89-0.99x cuDNN in the same call, against "ws"'s 255-262
    (``bsp_prefill_study_h200.json``): the default for head dim 128 on sm_90.
    ``ablate`` (``ws`` only, :data:`ABLATIONS`): a timing study leaving one part of the kernel out.
    ``persist`` ("v5" only; named "v5p"): a persistent grid of about one wave, each CTA looping over
    tiles of its head, so the producer loads a tile's first K/V blocks while the consumers finish
    the tile before (short rows, e.g. 32k at 10-20% kept, spend much of a tile in its prologue and
    epilogue: 0.57-0.71x cuDNN on computed tiles there, ``bsp_prefill_h200.json``).
    """

    impl: str = "mma"
    mt: int = 2
    warps: int = 4
    stages: int = 3  # "ws"/"wsi": K/V ring depth
    ablate: int = 0
    persist: bool = False

    def __post_init__(self) -> None:
        ok = (self.impl == "mma" or (self.impl == "wg" and self.mt == 1 and self.warps % 4 == 0)
              or (self.impl in WS_IMPLS and self.mt == 1 and self.warps == 8 and 2 <= self.stages <= 4)
              or (self.impl == V4 and self.mt == 1 and self.warps == 8 and self.stages in V4_STAGES)
              or (self.impl == V5 and self.mt == 1 and self.warps == 8 and 2 <= self.stages <= 4))
        if (not ok or self.mt < 1 or self.warps < 1 or (self.ablate and (self.impl != "ws" or self.ablate not in ABLATIONS))
                or (self.persist and self.impl != V5)):
            raise ValueError(f"bad tile shape {self}")

    @property
    def rows(self) -> int:
        """Query rows ((position, query head) pairs) of one CTA."""
        return self.warps * 16 * self.mt

    @property
    def threads(self) -> int:
        """Threads of one CTA (the warp-specialized kernel adds its producer warpgroup)."""
        return 32 * self.warps + (128 if self.warp_specialized else 0)

    @property
    def warp_specialized(self) -> bool:
        """A producer warpgroup feeds a ring of K/V stages ("ws", "wsp", "wsi", "v4", "v5")."""
        return self.impl in WS_IMPLS or self.impl in (V4, V5)

    @property
    def name(self) -> str:
        if self.warp_specialized:
            impl = self.impl + ("p" if self.persist else "")
            return f"{impl}_s{self.stages}" + (f"_{ABLATIONS[self.ablate]}" if self.ablate else "")
        return f"{self.impl}_mt{self.mt}_w{self.warps}"

    def supports(self, head_dim: int) -> bool:
        """Head dims this kernel is built and checked for ("wg" failed parity at 64; "ws" is written for 128)."""
        return head_dim in ((64, 128) if self.impl == "mma" else (128,))

    def smem_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory of one CTA: the Q tile and the stages of K and V blocks (two for
        "mma"/"wg"; "ws" and "v5": ``stages``, 1024-byte aligned for the swizzle, plus two mbarriers per stage;
        "v4": ``stages`` K tiles and V tiles of 128 keys, the swizzled Q tile and four mbarriers per stage)."""
        if self.impl == V4:
            return 1024 + self.stages * 2 * 2 * BN * head_dim * 2 + self.rows * head_dim * 2 + 32 * self.stages
        if self.impl in WS_IMPLS or self.impl == V5:
            return 1024 + self.stages * 2 * BN * head_dim * 2 + self.rows * (head_dim + 8) * 2 + 16 * self.stages
        if self.impl == "wg":
            return 4 * BN * head_dim * 2 + self.rows * (head_dim + 8) * 2
        return (self.rows + 4 * BN) * (head_dim + 8) * 2

    def variant(self, dtype: str, head_dim: int):
        from lserve.kernels.loader import Variant

        if not self.supports(head_dim):
            raise ValueError(f"the {self.impl} prefill kernel is checked for head_dim 128 only, not {head_dim}")
        if self.impl == "wg":
            return Variant("bsp_prefill_wg", dtype, head_dim, tuning=(f"LS_BSP_WG={self.warps // 4}",))
        if self.impl == V4:
            return Variant("bsp_prefill_ws4", dtype, head_dim, tuning=(f"LS_BSP_STAGES={self.stages}",))
        if self.impl == V5:
            persist = ("LS_BSP_PERSIST=1",) if self.persist else ()
            return Variant("bsp_prefill_v5", dtype, head_dim, tuning=(f"LS_BSP_STAGES={self.stages}", *persist))
        if self.impl in WS_IMPLS:
            ablate = (f"LS_BSP_ABLATE={self.ablate}",) if self.ablate else ()
            return Variant("bsp_prefill_ws", dtype, head_dim,
                           tuning=(f"LS_BSP_SWIZZLE={WS_IMPLS[self.impl][0]}", f"LS_BSP_PINGPONG={WS_IMPLS[self.impl][1]}",
                                   f"LS_BSP_STAGES={self.stages}", *ablate))
        return Variant("bsp_prefill", dtype, head_dim, tuning=(f"LS_BSP_MT={self.mt}", f"LS_BSP_WARPS={self.warps}"))


MMA = TileShape()  # any sm_80+ GPU, head dims 64 and 128 (benchmarks/bsp_prefill/bsp_prefill_h200.json)
WS = TileShape("ws", mt=1, warps=8, stages=3)  # sm_90, head dim 128 (bsp_prefill_ws_h200.json)
TMA = TileShape(V5, mt=1, warps=8, stages=3)  # sm_90, head dim 128 (bsp_prefill_study_h200.json)
#: TFLOP/s on computed tiles each kernel measured on the H200 (PathCost's kernel rate; "v5": 466-528
#: at 20% kept, 552-592 every block kept)
MEASURED_RATE = {"mma": 220e12, "ws": 255e12, V5: 500e12}


def default_shape(head_dim: int, capability: tuple[int, int]) -> TileShape:
    """The fastest measured kernel for this head dim on a device of this compute capability."""
    return TMA if capability == (9, 0) and TMA.supports(head_dim) else MMA


def supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Activations and head dims the kernel is built for (its accumulators fit registers to D 128)."""
    return dtype in (torch.bfloat16, torch.float16) and head_dim in (64, 128)


@dataclass(frozen=True)
class PathCost:
    """Which path runs a block list faster: this kernel (time ~ FLOPs / ``kernel_rate``) or the
    gathered-cuDNN path of :func:`lserve.attention.block_sparse_prefill.sparse_prefill` (FLOPs /
    ``cudnn_rate`` plus ``row_cost`` seconds of gathers, launches and merge per query row).

    Defaults fitted to one Llama-3-8B layer on the H200 (``benchmarks/bsp_prefill/bsp_prefill_h200.json``:
    the mma kernel 213-224 TFLOP/s on computed tiles, ``MEASURED_RATE`` per kernel; gathered
    16.4-17 ms at 32k whatever the kept fraction, 45-90 ms at 128k for 10-50% kept): the mma
    kernel wins at every measured fraction at 32k, up to ~20% kept at 128k and ~10% at 256k.
    """

    kernel_rate: float = 220e12
    cudnn_rate: float = 600e12
    row_cost: float = 0.6e-3

    def kernel_faster(self, flops: float, n_rows: int) -> bool:
        return flops / self.kernel_rate < flops / self.cudnn_rate + n_rows * self.row_cost


@dataclass
class PrefillSeq:
    """One sequence's prefill chunk in a launch.

    Parameters
    ----------
    t0 : int
        Row of the chunk's first query in the step's q/k/v/out tensors.
    start : int
        Tokens cached before the chunk (its first query's position).
    n_new : int
        Queries (and keys) of the chunk.
    page_off : int
        Offset of the sequence's dense pages in the launch's page table.
    blocks : PrefillBlocks, optional
        The dense heads' kept blocks of this chunk (``block == BN``); None: every causal block.
    """

    t0: int
    start: int
    n_new: int
    page_off: int = 0
    blocks: PrefillBlocks | None = None


@dataclass
class BspPlan:
    """Device tables of one launch (see ``kernels/bsp_prefill.cu``)."""

    tiles: torch.Tensor  # int32 [n_tiles, 4]: sequence, q0, q1, list row (-1: every causal block)
    seqs: torch.Tensor  # int32 [n_seq, 4]: t0, start, n_new, page_off
    rowptr: torch.Tensor | None  # int32 [n_dense, n_rows, 2]: (first, end) into indices
    indices: torch.Tensor | None  # int32 kept block ids
    n_rows: int
    group: int
    shape: TileShape = MMA

    @property
    def n_tiles(self) -> int:
        return self.tiles.shape[0]


def plan(seqs: list[PrefillSeq], group: int, n_dense: int, device: torch.device | str,
         shape: TileShape = MMA) -> BspPlan:
    """Cut every sequence's queries into tiles of ``shape.rows // group`` positions that never
    straddle a block-list row, heaviest (latest) tiles first, and concatenate the block lists."""
    npos = shape.rows // group
    if npos < 1:
        raise ValueError(f"a GQA group of {group} does not fit a tile of {shape.rows} rows")
    tiles, rowptrs, idx = [], [], []
    n_rows = nnz = 0
    for i, s in enumerate(seqs):
        end = s.start + s.n_new
        b = s.blocks
        if b is None:
            tiles += [(i, p, min(end, p + npos), -1) for p in range(s.start, end, npos)]
            continue
        if b.block != BN or b.start != s.start or b.length != end or b.indptr.shape[0] != n_dense:
            raise ValueError(f"block list (block {b.block}, positions {b.start}..{b.length}, {b.indptr.shape[0]} "
                             f"heads) does not match the chunk (block {BN}, {s.start}..{end}, {n_dense} heads)")
        for r in range(b.n_rows):
            rs, re = b.row_span(r)
            tiles += [(i, p, min(re, p + npos), n_rows + r) for p in range(max(rs, s.start), re, npos)]
        ip = b.indptr.to(device=device, dtype=torch.int32)
        rowptrs.append(torch.stack((ip[:, :-1], ip[:, 1:]), -1) + nnz)
        idx.append(b.indices.to(device=device, dtype=torch.int32))
        nnz += b.indices.numel()
        n_rows += b.n_rows
    tiles.sort(key=lambda t: -t[2])  # causal: later tiles visit more blocks, start them first
    seq_t = torch.tensor([[s.t0, s.start, s.n_new, s.page_off] for s in seqs], dtype=torch.int32)
    tile_t = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 4)
    return BspPlan(upload(tile_t, device), upload(seq_t, device), torch.cat(rowptrs, 1) if rowptrs else None,
                   torch.cat(idx) if idx else None, n_rows, group, shape)


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, p: BspPlan, n_dense: int,
        head0: int, n_heads: int, scale: float, sink: int = 0, local: int = 0,
        pool: tuple[torch.Tensor, torch.Tensor] | None = None, pages: torch.Tensor | None = None) -> None:
    """Launch the kernel over KV heads ``[head0, head0 + n_heads)`` of every tile of ``p``.

    Parameters
    ----------
    q, out : torch.Tensor
        [T, H_q, D] rows of the step (bf16/fp16; row stride free, heads contiguous).
    k, v : torch.Tensor
        [T, H_kv, D] the step's keys/values: read by streaming heads, and by dense heads when
        ``pool`` is None (every sequence then needs ``start == 0``).
    p : BspPlan
    n_dense : int
        KV heads ``< n_dense`` are dense (block lists, pool), the others streaming (sink + local).
    pool : tuple of torch.Tensor, optional
        Dense K and V pools [P, n_dense, page_size, D], contiguous; ``pages`` int32 holds each
        sequence's pages from its ``page_off``.

    The "v5" shape also takes the pools' TMA tensor maps (:func:`tma_maps`) and the tile count
    (its persistent form launches fewer CTAs than tiles).
    """
    from lserve.kernels.loader import LOG2E, f32, i32, i64, launch, ptr

    d = q.shape[-1]
    kern = kernel(p.shape, q.dtype, d)
    pk, pv = pool if pool is not None else (None, None)
    pool_heads, page_size = (pk.shape[1], pk.shape[2]) if pk is not None else (0, 1)
    # a persistent grid: one CTA per SM (the kernel's shared memory fits one), split over the heads
    ctas = min(p.n_tiles, max(1, -(-_num_sms(q.device) // n_heads))) if p.shape.persist else p.n_tiles
    v5 = (ptr(tma_maps(pk, pv)), i32(p.n_tiles)) if p.shape.impl == V5 else ()
    launch(kern, (ctas, n_heads), (p.shape.threads,),
           (ptr(q), i64(q.stride(0)), ptr(out), i64(out.stride(0)), ptr(k), ptr(v), i64(k.stride(0)),
            ptr(pk), ptr(pv), i32(pool_heads), i32(page_size), ptr(pages), ptr(p.tiles), ptr(p.seqs),
            ptr(p.rowptr), ptr(p.indices), i32(p.n_rows), i32(head0), i32(n_dense), i32(p.group),
            i32(sink), i32(local), f32(scale * LOG2E)) + v5,
           shared_mem=p.shape.smem_bytes(d))


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def kernel(shape: TileShape, dtype: torch.dtype, head_dim: int):
    """The compiled kernel of ``shape`` for these activations (compiled or read from the disk
    cache at the first call of a process: a server calls it at start, not at its first chunk)."""
    from lserve.kernels.loader import FAMILIES, get_kernel

    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if name is None:
        raise ValueError(f"bsp_prefill runs bf16/fp16 activations, got {dtype}")
    var = shape.variant(name, head_dim)
    return get_kernel(var, FAMILIES[var.family][1][0])


def tma_maps(pool_k: torch.Tensor | None, pool_v: torch.Tensor | None) -> torch.Tensor | None:
    """The "v5" kernel's tensor maps of the pools (:func:`lserve.kernels.tensor_map.pool_tensor_maps`),
    or None where it copies every block with cp.async as "ws" does: no pool, or pages that TMA
    boxes do not tile (:func:`lserve.kernels.tensor_map.box_rows`).

    Raises
    ------
    ValueError
        For a pool that is not contiguous (the kernel's cp.async path computes contiguous offsets).
    """
    from lserve.kernels.tensor_map import box_rows, pool_tensor_maps

    if pool_k is None:
        return None
    if not (pool_k.is_contiguous() and pool_v.is_contiguous()):
        raise ValueError("the v5 prefill kernel needs contiguous K/V pools")
    if box_rows(pool_k.shape[2], BN) is None:
        return None
    return pool_tensor_maps(pool_k, pool_v, BN)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, n_dense: int, scale: float,
              blocks: PrefillBlocks | None = None, sink: int = 0, local: int = 0) -> torch.Tensor:
    """What the kernel computes for one chunk, in float32 torch.

    q: [n, H_q, D] queries of positions ``start ..``; k, v: [start + n, H_kv, D] keys of positions
    0 ..; returns [n, H_q, D] float32. Dense heads: causal over ``blocks``' kept tiles (every causal
    tile when None); streaming heads: causal over ``t < sink or p - t < local``.
    """
    n, hq, d = q.shape
    L, hkv, _ = k.shape
    g = hq // hkv
    qpos = torch.arange(start, start + n, device=q.device)[:, None]
    kpos = torch.arange(L, device=q.device)[None, :]
    causal = kpos <= qpos  # [n, L]
    masks = []
    for h in range(hkv):
        if h < n_dense:
            masks.append(blocks.token_mask()[h].to(q.device) if blocks is not None else causal)
        else:
            masks.append(causal & ((kpos < sink) | (qpos - kpos < local)))
    mask = torch.stack(masks).repeat_interleave(g, 0)  # [H_q, n, L]
    kk = k.float().transpose(0, 1).repeat_interleave(g, 0)
    vv = v.float().transpose(0, 1).repeat_interleave(g, 0)
    s = torch.bmm(q.float().transpose(0, 1), kk.transpose(1, 2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.bmm(torch.softmax(s, -1), vv).transpose(0, 1)
