"""The fused antidiagonal estimate (``kernels/prefill_estimate.cu``) against the torch estimator it
replaces, on fresh random inputs: fresh prompts and chunks with cached past, GQA groups 1/4/7,
head dims 64/128, bf16/fp16/fp32, rows split over several GEMMs and a row over several CTAs; then the block lists both give."""

import pytest
import torch

from lserve.attention.prefill_estimate import antidiagonal_masses
from lserve.sparsity.prefill_blocks import estimate_masses, prefill_blocks

pytestmark = pytest.mark.gpu

CASES = [  # (dtype, hkv, group, D, start, n, block, q_block, stride, max_bytes, groups, splits)
    (torch.bfloat16, 2, 4, 128, 0, 5000, 64, 256, 16, 1 << 29, 4, 1),
    (torch.bfloat16, 1, 7, 128, 3000, 1500, 64, 128, 8, 1 << 29, 4, 1),
    (torch.float16, 2, 1, 64, 0, 2100, 32, 64, 8, 1 << 16, 4, 1),  # many GEMMs of few rows
    (torch.bfloat16, 2, 4, 64, 777, 4096, 64, 2048, 16, 1 << 29, 4, 1),  # a chunk not aligned to its row
    (torch.float32, 1, 4, 128, 0, 1000, 64, 128, 16, 1 << 29, 4, 1),
    (torch.bfloat16, 2, 4, 128, 0, 5000, 64, 256, 16, 1 << 29, 8, 4),  # a row's groups over 4 CTAs (atomics)
    (torch.bfloat16, 1, 7, 128, 3000, 1500, 64, 128, 8, 1 << 29, 2, 16),  # one group per CTA, past skipped
]


@pytest.mark.parametrize("passes", [3, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-h{c[1]}g{c[2]}d{c[3]}-s{c[4]}n{c[5]}-g{c[10]}z{c[11]}")
def test_fused_estimate_matches_torch(case, passes):
    dt, hkv, g, d, start, n, B, QB, S, mb, groups, splits = case
    gen = torch.Generator(device="cuda").manual_seed(start + n)
    L = start + n
    q = torch.randn(hkv * g, n, d, device="cuda", generator=gen).mul_(2).to(dt)  # peaked enough to matter
    k = torch.randn(hkv, L, d, device="cuda", generator=gen).to(dt)
    scale = d ** -0.5
    ref = estimate_masses(q, k, start, B, scale, "antidiagonal", S, QB)
    got = antidiagonal_masses(q, k, start, B, QB, scale, S, max_bytes=mb, groups=groups, splits=splits, passes=passes)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    assert torch.allclose(got.sum(-1), torch.ones_like(got[..., 0]), atol=1e-4)  # rows are distributions
    assert (got - ref).abs().max().item() < 2e-3, (got - ref).abs().max().item()
    a = prefill_blocks(q, k, start, B, scale, 0.6, "antidiagonal", S, QB)
    b = prefill_blocks(q, k, start, B, scale, 0.6, "antidiagonal", S, QB,
                       estimate=lambda *x: antidiagonal_masses(x[0], x[1], x[2], x[3], x[7] or x[3], x[4], x[6]))
    assert abs(a.kept_fraction() - b.kept_fraction()) < 0.02
