"""The one-call flash path of chunked prefill against plain attention (random inputs, GQA groups,
ragged chunk/past lengths, head dims 64 and 128)."""

from __future__ import annotations

import pytest
import torch

from lserve.attention.chunked import _math_lse, causal_attention, causal_impl


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("lq, lk", [(1, 700), (77, 77), (250, 1337), (512, 4096)])
def test_causal_attention_matches_plain(group, d, lq, lk, seed):
    dev = torch.device("cuda")
    if causal_impl(dev, torch.bfloat16, d) is None:
        pytest.skip("no exact flash variant on this GPU (the backend keeps the LSE-merge path)")
    g = torch.Generator(device=dev).manual_seed(seed)
    hkv = 2
    q = torch.randn(hkv * group, lq, d, generator=g, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(hkv, lk + 32, d, generator=g, device=dev, dtype=torch.bfloat16)[:, :lk] for _ in "kv")
    o = causal_attention(q, k, v, d ** -0.5)
    ref, _ = _math_lse(q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), True, d ** -0.5)
    err = (o.float() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2, float(err)
