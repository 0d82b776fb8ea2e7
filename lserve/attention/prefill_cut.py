"""The mass cut of a prefill chunk on the GPU: its block list from the estimate's masses in two launches.

:func:`lserve.sparsity.prefill_blocks.select_blocks` after
:func:`~lserve.sparsity.prefill_blocks.combine_group` is the oracle: ~30 small torch ops (a sort of
every row's tiles, a cumulative sum, a scatter, a ``nonzero``), 0.58 ms a layer beside the fused
estimate at 128k on an H100, 0.17 ms here (``benchmarks/bsp_prefill/bsp_prefill_cut_h100.json``).
``ls_mass_rank`` (``kernels/prefill_cut.cu``) ranks each (row, KV head)'s tiles in shared memory
and counts what reaching ``tau`` needs; ``ls_mass_keep`` writes the BSR list. The same rule, so the
lists are equal but where a row's mass reaches ``tau`` within float32 rounding of another sum order.
"""

from __future__ import annotations

import torch

from lserve.kernels.loader import KernelError, Variant, f32, get_kernel, i32, launch, ptr
from lserve.sparsity.prefill_blocks import PrefillBlocks, causal_tile_count, chunk_rows

THREADS = 512  # CUT_THREADS of the kernels
DEVICE_TYPE = "cuda"  # where the kernels run (a CPU test swaps in an emulation of them)
MAX_SHARED = 200 * 1024
NO_TAIL = 2**31 - 1  # dense_from of a chunk without the prompt's tail


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def shared_bytes(nkb: int) -> int:
    """Dynamic shared memory of ``ls_mass_rank`` for rows of up to ``nkb`` tiles."""
    return (2 * _pow2(nkb) + nkb) * 4


def fits(length: int, block: int) -> bool:
    """Whether a chunk ending at ``length`` can be cut here (its rows' tiles in shared memory)."""
    return shared_bytes(-(-length // block)) <= MAX_SHARED


def mass_cut(mass: torch.Tensor, group: int, tau: float, start: int, length: int, block: int,
             q_block: int | None = None, dense_from: int | None = None) -> PrefillBlocks:
    """:func:`~lserve.sparsity.prefill_blocks.select_blocks` of
    :func:`~lserve.sparsity.prefill_blocks.combine_group` (``mass``, ``group``), on the GPU.

    Parameters
    ----------
    mass : torch.Tensor
        float32 [H_kv * G, R, n_kv_blocks] per query head (:func:`~lserve.attention.prefill_estimate.antidiagonal_masses`).
    group : int
        G, query heads per KV head.
    tau, start, length, block, q_block, dense_from
        As :func:`~lserve.sparsity.prefill_blocks.select_blocks` (``tau`` < 1).

    Returns
    -------
    PrefillBlocks
    """
    hq, R, nkb = mass.shape
    qb = q_block or block
    b0, rows = chunk_rows(start, length, qb)
    if mass.dtype != torch.float32 or mass.device.type != DEVICE_TYPE or hq % group:
        raise KernelError(f"mass cut: float32 CUDA masses of whole groups, got {mass.dtype} on {mass.device}")
    if rows != R or nkb != -(-length // block) or qb % block or not 0 <= tau < 1 or not fits(length, block):
        raise KernelError(f"mass cut: masses {tuple(mass.shape)} do not fit start {start}, length {length}, "
                          f"block {block}, q_block {qb}, tau {tau}")
    h = hq // group
    tail = NO_TAIL if dense_from is None else dense_from
    geometry = (i32(b0), i32(qb), i32(block), i32(length), i32(tail))
    need = torch.empty(h, R, dtype=torch.int32, device=mass.device)
    rank = torch.empty(h, R, nkb, dtype=torch.int32, device=mass.device)
    rank_k = get_kernel(Variant("prefill_cut", "fp32", 128), "ls_mass_rank")
    launch(rank_k, (R, h), (THREADS,), (ptr(mass.contiguous()), i32(group), i32(R), i32(nkb), *geometry, f32(tau),
                                        i32(_pow2(nkb)), ptr(need), ptr(rank)), shared_mem=shared_bytes(nkb))
    indptr = torch.empty(h, R + 1, dtype=torch.int32, device=mass.device)
    indices = torch.empty(h * causal_tile_count(start, length, block, qb), dtype=torch.int32, device=mass.device)
    keep_k = get_kernel(Variant("prefill_cut", "fp32", 128), "ls_mass_keep")
    launch(keep_k, (R, h), (THREADS,), (ptr(need), ptr(rank), i32(h), i32(R), i32(nkb), *geometry, ptr(indptr),
                                        ptr(indices)))
    nnz = int(indptr[-1, -1])  # one read back: the list's length (a torch cut's nonzero reads it too)
    return PrefillBlocks(indptr, indices[:nnz], block, start, length, qb)
