"""The host side of the fused antidiagonal estimate (row groups, padding, kernel arguments),
checked on the CPU: the kernel is replaced by a torch emulation of what kernels/prefill_estimate.cu
computes from its arguments, and the result must equal the torch estimator's. The kernel itself is
checked against the torch estimator on the GPU (tests/gpu/test_prefill_estimate_gpu.py)."""

import itertools
import math

import pytest
import torch

from lserve.attention import prefill_estimate as pe
from lserve.sparsity.prefill_blocks import estimate_masses


def _emulated_kernel(grid, block, args, shared_mem=0):
    """ls_antidiag_mass, one (row, query head) CTA at a time, in float32 torch."""
    s, ng, nkg, qg0, gpr, kpb, nkg_valid, S, start, L, q_block, blk, c, out, R, nkb, r0 = args
    s = s.reshape(out.shape[0], ng, nkg).float()
    for rl in range(grid[0]):
        rs = (qg0 // gpr + rl) * q_block
        re = min(L, rs + q_block)
        nb = (re - 1) // blk + 1
        a1 = min(ng, (rl + 1) * gpr)
        n_valid = sum(1 for a in range(rl * gpr, a1) if (qg0 + a) * S + S > start and (qg0 + a) * S < L)
        for hq, z in itertools.product(range(grid[1]), range(grid[2])):
            acc = torch.zeros(nb)
            for a in range(rl * gpr + z, a1, grid[2]):
                qg = qg0 + a
                if qg * S + S <= start or qg * S >= L:
                    continue
                kmax = min(qg, nkg_valid - 1)
                row = s[hq, a, : kmax + 1] * c
                p = torch.exp2(row - row.max())
                p = p / p.sum()
                padded = torch.zeros(nb * kpb)
                padded[: kmax + 1] = p
                acc += padded.view(nb, kpb).sum(1)
            out[hq, r0 + rl, :nb] += acc / max(n_valid, 1)  # the caller zeroes out; splits add


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(pe, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(pe, "get_kernel", lambda variant, name: name)
    monkeypatch.setattr(pe, "launch", lambda kern, grid, block, args, shared_mem=0: _emulated_kernel(grid, block, args))
    monkeypatch.setattr(pe, "ptr", lambda t: t)
    monkeypatch.setattr(pe, "i32", int)
    monkeypatch.setattr(pe, "f32", float)


@pytest.mark.parametrize("hkv,g,d,start,n,B,QB,S,max_bytes,groups,splits", [
    (2, 4, 16, 0, 700, 32, 128, 8, 1 << 29, 4, 1),  # fresh prompt, last row partial
    (1, 7, 8, 300, 333, 16, 64, 8, 1 << 29, 4, 1),  # a chunk with cached past, not row-aligned
    (2, 1, 16, 0, 1100, 32, 64, 16, 1 << 12, 4, 1),  # memory bound: one row per GEMM
    (2, 4, 16, 0, 700, 32, 128, 8, 1 << 29, 8, 3),  # a row's query groups split over 3 CTAs, uneven
    (1, 7, 8, 300, 333, 16, 64, 8, 1 << 29, 2, 8),  # splits = every query group of a row, past skipped
])
def test_row_groups_and_arguments_reproduce_the_torch_estimator(emulated, hkv, g, d, start, n, B, QB, S, max_bytes,
                                                               groups, splits):
    gen = torch.Generator().manual_seed(n)
    L = start + n
    q = torch.randn(hkv * g, n, d, generator=gen) * 2
    k = torch.randn(hkv, L, d, generator=gen)
    scale = 1 / math.sqrt(d)
    ref = estimate_masses(q, k, start, B, scale, "antidiagonal", S, QB)
    got = pe.antidiagonal_masses(q, k, start, B, QB, scale, S, max_bytes=max_bytes, groups=groups, splits=splits)
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


def test_refusals():
    q = torch.zeros(4, 10, 8)
    with pytest.raises(pe.KernelError, match="CUDA"):
        pe.antidiagonal_masses(q, torch.zeros(1, 10, 8), 0, 16, 64, 1.0, 8)


def test_bad_row_groups_or_splits_are_refused(emulated):
    q, k = torch.randn(4, 128, 8), torch.randn(1, 128, 8)
    for bad in (dict(groups=0), dict(splits=0), dict(splits=9)):  # q_block 64 / stride 8 = 8 query groups a row
        with pytest.raises(pe.KernelError, match="splits"):
            pe.antidiagonal_masses(q, k, 0, 16, 64, 1.0, 8, **bad)


def test_two_passes_launch_their_kernel_with_both_arrays_and_fall_back_where_they_do_not_fit(emulated, monkeypatch):
    launches = []

    def record(kern, grid, block, args, shared_mem=0):
        launches.append((kern, shared_mem))
        _emulated_kernel(grid, block, args)

    monkeypatch.setattr(pe, "launch", record)
    q, k = torch.randn(4, 256, 8), torch.randn(1, 256, 8)
    ref = estimate_masses(q, k, 0, 16, 1.0, "antidiagonal", 8, 64)
    got = pe.antidiagonal_masses(q, k, 0, 16, 64, 1.0, 8, passes=2)
    assert torch.allclose(got, ref, atol=1e-5)
    assert set(launches) == {("ls_antidiag_mass2", 2 * 16 * 4)}  # 16 key blocks: acc and part
    launches.clear()
    monkeypatch.setattr(pe, "MAX_SHARED", 16 * 4)  # one row's sums fit, two arrays do not: three passes
    pe.antidiagonal_masses(q, k, 0, 16, 64, 1.0, 8, passes=2)
    assert set(launches) == {("ls_antidiag_mass", 16 * 4)}
    with pytest.raises(pe.KernelError, match="passes"):
        pe.antidiagonal_masses(q, k, 0, 16, 64, 1.0, 8, passes=1)
