"""The host side of the GPU mass cut (kernel arguments, the list's layout and length), checked on the
CPU: the two kernels are replaced by a plain emulation of what kernels/prefill_cut.cu computes from
its arguments, and the block list must equal the torch cut's (``select_blocks`` of
``combine_group``). The kernels themselves are checked on the GPU (tests/gpu/test_prefill_cut_gpu.py)."""

import pytest
import torch

from lserve.attention import prefill_cut as pc
from lserve.sparsity.prefill_blocks import combine_group, select_blocks


def _row(r, b0, qb, block, length, dense_from):
    rs = (b0 + r) * qb
    re = min(length, rs + qb)
    return (re - 1) // block + 1, rs // block, re > dense_from


def _emulated_rank(grid, args):
    mass, G, R, nkb, b0, qb, block, length, dense_from, tau, p2, need, rank = args
    for r in range(grid[0]):
        nb, first, tail = _row(r, b0, qb, block, length, dense_from)
        if tail:
            continue
        for h in range(grid[1]):
            m = mass[h * G:(h + 1) * G, r].amax(0)
            ms = (m[:nb] / m.sum().clamp(min=1e-30)).tolist()
            pr = [2.0 if j == 0 or j >= first - 1 else ms[j] for j in range(nb)]
            before, cnt = 0.0, 0
            for i, j in enumerate(sorted(range(nb), key=lambda j: (-pr[j], j))):
                cnt += before < tau
                rank[h, r, j] = i
                before += ms[j]
            need[h, r] = max(cnt, nb if first <= 1 else 1 + nb - (first - 1))


def _emulated_keep(grid, args):
    need, rank, H, R, nkb, b0, qb, block, length, dense_from, indptr, indices = args

    def count(r):
        nb, _, tail = _row(r, b0, qb, block, length, dense_from)
        if tail:
            return nb
        q = qb // block
        return min(nb, -(-int(need[:, r].max()) // q) * q)

    n = [count(r) for r in range(R)]
    for r in range(grid[0]):
        nb, _, tail = _row(r, b0, qb, block, length, dense_from)
        for h in range(grid[1]):
            off = h * sum(n) + sum(n[:r])
            indptr[h, r] = off
            if r == R - 1:
                indptr[h, R] = off + n[r]
            kept = [j for j in range(nb) if tail or rank[h, r, j] < n[r]]
            indices[off: off + len(kept)] = torch.tensor(kept, dtype=torch.int32)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(pc, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(pc, "get_kernel", lambda variant, name: name)
    kernels = {"ls_mass_rank": _emulated_rank, "ls_mass_keep": _emulated_keep}
    monkeypatch.setattr(pc, "launch", lambda kern, grid, block, args, shared_mem=0: kernels[kern](grid, args))
    monkeypatch.setattr(pc, "ptr", lambda t: t)
    monkeypatch.setattr(pc, "i32", int)
    monkeypatch.setattr(pc, "f32", float)


def _masses(gen, hq, start, length, block, qb):
    """Random per-query-head shares: zero past each row's causal tiles, rows summing to 1."""
    b0 = start // qb
    R = (length - 1) // qb - b0 + 1
    nkb = -(-length // block)
    m = torch.rand(hq, R, nkb, generator=gen) ** 4  # skewed, as attention is
    for r in range(R):
        m[:, r, (min(length, (b0 + r + 1) * qb) - 1) // block + 1:] = 0
    return m / m.sum(-1, keepdim=True)


@pytest.mark.parametrize("hkv,g,start,length,block,qb,tau,dense_from", [
    (2, 4, 0, 2000, 32, 128, 0.5, None),  # a fresh prompt, last row partial
    (1, 7, 700, 1900, 16, 64, 0.8, None),  # a chunk with a past, not row-aligned
    (4, 1, 0, 4096, 64, 256, 0.3, 3840),  # the prompt's tail keeps every causal tile
    (2, 4, 1024, 3000, 32, 32, 0.95, None),  # square tiles (quantum 1)
])
def test_emulated_kernels_give_the_torch_cut(emulated, hkv, g, start, length, block, qb, tau, dense_from):
    gen = torch.Generator().manual_seed(length + start)
    mass = _masses(gen, hkv * g, start, length, block, qb)
    ref = select_blocks(combine_group(mass, g), tau, start, length, block, qb, dense_from)
    got = pc.mass_cut(mass, g, tau, start, length, block, qb, dense_from)
    assert torch.equal(got.indptr, ref.indptr)
    assert torch.equal(got.indices, ref.indices)
    assert 0 < got.kept_fraction() < 1


def test_ties_keep_the_lower_tile_in_both_cuts(emulated):
    """Equal masses (a uniform row): both cuts keep the lowest tiles, the stable sort's order."""
    start, length, block, qb = 0, 1024, 32, 64
    mass = _masses(torch.Generator().manual_seed(0), 4, start, length, block, qb)
    mass = (mass > 0).float()
    mass /= mass.sum(-1, keepdim=True)
    ref = select_blocks(combine_group(mass, 4), 0.3, start, length, block, qb)
    got = pc.mass_cut(mass, 4, 0.3, start, length, block, qb)
    assert torch.equal(got.indices, ref.indices) and torch.equal(got.indptr, ref.indptr)


def test_refusals(emulated):
    mass = torch.rand(4, 2, 32)
    with pytest.raises(pc.KernelError, match="float32"):
        pc.mass_cut(mass.half(), 4, 0.5, 0, 1024, 32, 512)
    with pytest.raises(pc.KernelError, match="do not fit"):
        pc.mass_cut(mass, 4, 0.5, 0, 1100, 32, 512)  # 1100 tokens are 35 tiles, not 32
    with pytest.raises(pc.KernelError, match="do not fit"):
        pc.mass_cut(mass, 4, 1.0, 0, 1024, 32, 512)  # tau 1 keeps everything: not a cut
    assert pc.fits(1 << 20, 64) and not pc.fits(1 << 22, 64)
