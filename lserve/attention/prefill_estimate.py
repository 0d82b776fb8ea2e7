"""The antidiagonal block-mass estimate of a prefill chunk on the GPU, without a per-row loop.

:func:`lserve.sparsity.prefill_blocks.estimate_masses` (``"antidiagonal"``) is the oracle: per
query row of ``q_block`` positions it runs a score GEMM and then six elementwise torch ops (scale,
causal mask, softmax, block sums, mean over the row's query groups), i.e. ~10 launches per row and
the scores read and written several times in fp32. Here the GEMM stays in cuBLAS, once per group
of rows (bounded by ``max_bytes`` of scores), and ``ls_antidiag_mass`` (``kernels/prefill_estimate.cu``)
does the rest in one launch over the 16-bit scores (three passes per query group, or two with
``ls_antidiag_mass2``): the same softmax and the same sums, so the masses agree with the oracle to
float32 rounding.
"""

from __future__ import annotations

import torch

from lserve.kernels.loader import LOG2E, KernelError, Variant, dtype_name, f32, get_kernel, i32, launch, ptr
from lserve.sparsity.prefill_blocks import pad_positions

THREADS = 512  # EST_THREADS of the kernel
DEVICE_TYPE = "cuda"  # where the kernel runs (a CPU test swaps in an emulation of it)
# The rows of a chunk are scored in about GEMM_GROUPS GEMMs (memory permitting), each followed by the
# mass kernel with SPLITS CTAs per (row, query head). Fewer rows per GEMM waste fewer FLOPs above the
# diagonal; splitting rows keeps the mass kernel's grid full when a GEMM covers few rows. Measured on
# the H200 (bsp_prefill_h200.json, llama3-8b layer, fused ms at 32k / 128k / 256k): 4 GEMMs x 1 CTA
# 1.75 / 6.97 / 24.97, 4 x 4 0.99 / 6.38 / 20.24, 8 x 1 2.55 / 8.05 / 25.15, 8 x 4 1.20 / 6.14 / 20.45,
# 16 x 8 2.11 / 6.20 / 20.17: 8 x 4 is fastest at 128k, where the estimate's 5% target is set.
GEMM_GROUPS = 8
SPLITS = 4
MAX_SHARED = 200 * 1024  # block sums of one row in shared memory: nkb * 4 bytes (x 2 with two passes)
# Passes of the mass kernel over a query group's scores: 3 (max; sum; block sums: ls_antidiag_mass)
# or 2 (max; block sums and their total, one exp2 a score: ls_antidiag_mass2, twice the shared
# memory). 3 is what the GPU tests and benchmarks have measured; 2 is timed beside it by the bench.
PASSES = 3
KERNELS = {3: "ls_antidiag_mass", 2: "ls_antidiag_mass2"}


def shared_bytes(length: int, block: int, passes: int = 3) -> int:
    """Dynamic shared memory of the mass kernel: one row's block sums (``ceil(length / block)``
    floats), twice that with two passes."""
    return -(-length // block) * 4 * (2 if passes == 2 else 1)


def fits(length: int, block: int, passes: int = 3) -> bool:
    """Whether the mass kernel's shared memory (:func:`shared_bytes`) fits."""
    return shared_bytes(length, block, passes) <= MAX_SHARED


def antidiagonal_masses(q: torch.Tensor, k: torch.Tensor, start: int, block: int, q_block: int, scale: float,
                        stride: int, max_bytes: int = 1 << 29, groups: int = GEMM_GROUPS,
                        splits: int = SPLITS, passes: int | None = None) -> torch.Tensor:
    """Per query head, the antidiagonal estimate of each causal tile's share of attention mass.

    Parameters
    ----------
    q : torch.Tensor
        [H_kv * G, Lq, D] the chunk's queries on a CUDA device (bf16, fp16 or fp32).
    k : torch.Tensor
        [H_kv, L, D] keys of positions 0 .. L - 1 (L = start + Lq), q's dtype.
    start, block, q_block, scale, stride : int, int, int, float, int
        As :func:`lserve.sparsity.prefill_blocks.estimate_masses` (``block`` a multiple of
        ``stride``, ``q_block`` of ``block``).
    max_bytes : int
        Most bytes of scores one GEMM writes (rows are grouped under it).
    groups, splits : int
        About how many GEMMs score the chunk's rows (memory permitting), and how many CTAs of the
        mass kernel share one (row, query head) (:data:`GEMM_GROUPS`, :data:`SPLITS`).
    passes : int or None
        The mass kernel's passes over the scores, 3 or 2 (None: :data:`PASSES`; 2 falls back to 3
        where its shared memory does not fit).

    Returns
    -------
    torch.Tensor
        float32 [H_kv * G, R, n_kv_blocks]; each row sums to 1 over its causal tiles.
    """
    hq, lq, d = q.shape
    h, L, _ = k.shape
    if dtype_name(q.dtype) is None or k.dtype != q.dtype or q.device.type != DEVICE_TYPE:
        raise KernelError(f"antidiagonal estimate: CUDA bf16/fp16/fp32 q and k of one dtype, got {q.dtype}/{k.dtype}")
    if groups < 1 or not 1 <= splits <= q_block // stride:
        raise KernelError(f"antidiagonal estimate: groups {groups} >= 1 and splits {splits} in 1 .. {q_block // stride}")
    if block % stride or q_block % block or L != start + lq:
        raise KernelError(f"antidiagonal estimate: block {block} / q_block {q_block} / stride {stride} / "
                          f"length {L} = start {start} + {lq} do not fit")
    g, S = hq // h, stride
    nkb = -(-L // block)
    passes = PASSES if passes is None else passes
    if passes not in KERNELS:
        raise KernelError(f"antidiagonal estimate: passes must be 3 or 2, got {passes}")
    if not fits(L, block):
        raise KernelError(f"antidiagonal estimate: {nkb} key blocks exceed one row's shared memory")
    if not fits(L, block, passes):
        passes = 3
    b0 = start // q_block
    R = (L - 1) // q_block - b0 + 1
    gpr, kpb = q_block // S, block // S
    kg = pad_positions(k, 0, nkb * block, 0).view(h, -1, S, d).flip(2).reshape(h, -1, S * d)  # [Hkv, nkb*B/S, S*D]
    out = torch.zeros(hq, R, nkb, dtype=torch.float32, device=q.device)
    kern = get_kernel(Variant("prefill_estimate", dtype_name(q.dtype), 128), KERNELS[passes])
    # A GEMM spans its rows up to the last one's causal extent: fewer rows per GEMM waste fewer
    # FLOPs above the diagonal (~1/(2 * GEMM_GROUPS) of the causal work), more rows fewer launches.
    per_row = hq * gpr * (nkb * kpb) * q.element_size()
    rows = max(1, min(R, max_bytes // per_row, -(-R // groups)))
    for r0 in range(0, R, rows):
        r1 = min(R, r0 + rows)
        lo, hi = (b0 + r0) * q_block, (b0 + r1) * q_block  # positions of the rows, zeros outside the chunk
        a, e = max(lo, start), min(hi, L)
        nkg = (e - 1) // block * kpb + kpb  # key groups of the last row's causal blocks
        qg = pad_positions(q[:, a - start: e - start], lo, hi, a).view(h, g * (r1 - r0) * gpr, S * d)
        s = torch.bmm(qg, kg[:, :nkg].transpose(1, 2))  # [Hkv, G * ng, nkg] = [Hq, ng, nkg]
        launch(kern, (r1 - r0, hq, splits), (THREADS,),
               (ptr(s), i32((r1 - r0) * gpr), i32(nkg), i32((b0 + r0) * gpr), i32(gpr), i32(kpb),
                i32(-(-L // S)), i32(S), i32(start), i32(L), i32(q_block), i32(block), f32(scale / S * LOG2E),
                ptr(out), i32(R), i32(nkb), i32(r0)), shared_mem=shared_bytes(L, block, passes))
    return out
