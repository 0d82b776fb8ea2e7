"""The GPU mass cut (``kernels/prefill_cut.cu``) against the torch cut it replaces (``select_blocks`` of
``combine_group``), on fresh random masses: fresh prompts and chunks with a past, rows of 1 to 32 tile
quanta, GQA groups 1/4/7, the prompt's tail, and the fused estimate's own masses at 32k."""

import pytest
import torch

from lserve.attention.prefill_cut import mass_cut
from lserve.attention.prefill_estimate import antidiagonal_masses
from lserve.sparsity.prefill_blocks import combine_group, select_blocks

pytestmark = pytest.mark.gpu


def _masses(gen, hq, start, length, block, qb):
    b0 = start // qb
    R = (length - 1) // qb - b0 + 1
    nkb = -(-length // block)
    m = torch.rand(hq, R, nkb, device="cuda", generator=gen) ** 4
    ends = (torch.arange(R, device="cuda") + b0 + 1) * qb
    nb = (ends.clamp(max=length) - 1) // block + 1
    m = m * (torch.arange(nkb, device="cuda")[None, :] < nb[:, None])
    return m / m.sum(-1, keepdim=True)


def _same(got, ref) -> None:
    """Equal lists, or (float32 sums in another order) rows whose counts differ by one quantum at most."""
    if torch.equal(got.indptr, ref.indptr) and torch.equal(got.indices, ref.indices):
        return
    a = (got.indptr[:, 1:] - got.indptr[:, :-1]).long()
    b = (ref.indptr[:, 1:] - ref.indptr[:, :-1]).long()
    q = got.q_block // got.block
    assert (a - b).abs().max() <= q and (a != b).float().mean() < 0.02, (a - b).abs().max()


@pytest.mark.parametrize("hkv,g,start,length,block,qb,tau,dense_from", [
    (4, 4, 0, 32768, 64, 2048, 0.5, None),
    (4, 4, 65536, 98304, 64, 2048, 0.9, None),  # a chunk with a 64k past
    (2, 7, 1000, 9000, 64, 256, 0.3, 8000),  # not row-aligned; the tail keeps every causal tile
    (8, 1, 0, 20000, 32, 32, 0.7, None),  # square tiles
    (1, 4, 0, 1 << 20, 64, 2048, 0.5, None),  # 16384 tiles a row: the largest sort
])
def test_gpu_cut_equals_the_torch_cut(hkv, g, start, length, block, qb, tau, dense_from):
    gen = torch.Generator(device="cuda").manual_seed(length + start)
    if length > 200_000:  # the last rows only: a chunk of 2 rows at 1M
        start = length - 2 * qb
    mass = _masses(gen, hkv * g, start, length, block, qb)
    ref = select_blocks(combine_group(mass, g), tau, start, length, block, qb, dense_from)
    got = mass_cut(mass, g, tau, start, length, block, qb, dense_from)
    _same(got, ref)
    assert got.indices.numel() == int(got.indptr[-1, -1])


def test_gpu_cut_of_the_fused_estimate():
    gen = torch.Generator(device="cuda").manual_seed(5)
    hkv, g, L, d = 4, 4, 32768, 128
    q = torch.randn(hkv * g, L, d, device="cuda", generator=gen).mul_(2).bfloat16()
    k = torch.randn(hkv, L, d, device="cuda", generator=gen).bfloat16()
    mass = antidiagonal_masses(q, k, 0, 64, 2048, d ** -0.5, 16)
    for tau in (0.2, 0.6, 0.95):
        ref = select_blocks(combine_group(mass, g), tau, 0, L, 64, 2048, L - 2048)
        _same(mass_cut(mass, g, tau, 0, L, 64, 2048, L - 2048), ref)
