"""The pieces of chunked-prefill attention (lserve.attention.chunked) against masked attention.

The cupy backend runs these on the GPU (tests/gpu/test_backend_parity.py prefills one sequence
in chunks in every scenario); here the math is checked on the CPU on random inputs.
"""

from __future__ import annotations

import pytest
import torch

from lserve.attention.chunked import attention_lse, dense_chunk, grid_segments, impl_ok, merge_lse, streaming_prefix


def masked_attention(q, k, v, mask, scale):
    """q: [H, Lq, D]; k, v: [H, Lk, D]; mask [Lq, Lk] bool -> [H, Lq, D] (float64 reference)."""
    s = torch.einsum("hqd,hkd->hqk", q.double(), k.double()) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,hkd->hqd", torch.softmax(s, -1), v.double())


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("lq,lk,causal", [(96, 96, True), (70, 333, False), (1, 500, False)])
def test_attention_lse_on_the_cpu_is_the_masked_softmax(lq, lk, causal, d):
    """The CPU path (torch's fused flash kernel where it checks exact, else plain attention): output
    and log-sum-exp of the masked softmax, keys as strided views as the backends pass them."""
    gen = torch.Generator().manual_seed(lq + lk + d)
    q = torch.randn(3, lq, d, generator=gen)
    k, v = (torch.randn(3, lk + 8, d, generator=gen)[:, :lk] for _ in "kv")
    o, lse = attention_lse(q, k, v, causal, d ** -0.5)
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if causal else torch.ones(lq, lk, dtype=torch.bool)
    s = (torch.einsum("hqd,hkd->hqk", q.double(), k.double()) * d ** -0.5).masked_fill(~mask, float("-inf"))
    assert torch.allclose(o.double(), masked_attention(q, k, v, mask, d ** -0.5), atol=1e-5, rtol=1e-4)
    assert torch.allclose(lse.double(), torch.logsumexp(s, -1), atol=1e-4)
    assert impl_ok("cpu_flash", torch.device("cpu"), torch.float32, d)  # torch 2.13 ships it: the fast path ran


@pytest.mark.parametrize("start,n,group", [(37, 19, 1), (300, 64, 4), (129, 200, 8)])
def test_dense_chunk_is_causal_attention_over_past_and_chunk(start, n, group):
    gen = torch.Generator().manual_seed(start + n)
    hd, d = 2, 32
    q = torch.randn(hd * group, n, d, generator=gen)
    k = torch.randn(hd, start + n, d, generator=gen)
    v = torch.randn(hd, start + n, d, generator=gen)
    got = dense_chunk(q, k[:, :start], v[:, :start], k[:, start:], v[:, start:], group, d ** -0.5)
    qpos = torch.arange(start, start + n)[:, None]
    mask = torch.arange(start + n)[None, :] <= qpos
    want = masked_attention(q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), mask, d ** -0.5)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-4)


def test_merge_lse_equals_attention_over_the_union():
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 5, 8, generator=gen), torch.randn(3, 11, 8, generator=gen), torch.randn(3, 11, 8, generator=gen)

    def part(a, b):
        s = torch.einsum("hqd,hkd->hqk", q, k[:, a:b]) * 0.3
        return torch.einsum("hqk,hkd->hqd", torch.softmax(s, -1), v[:, a:b]), torch.logsumexp(s, -1)

    got = merge_lse(*part(0, 4), *part(4, 11))
    assert torch.allclose(got, part(0, 11)[0], atol=1e-6)


def lam_mask(qpos, kpos, sink, local):
    rel = qpos[:, None] - kpos[None, :]
    return (rel >= 0) & ((kpos[None, :] < sink) | (rel < local))


@pytest.mark.parametrize("start,n,sink,local", [(40, 30, 16, 32), (500, 100, 64, 128), (48, 64, 16, 32),
                                                (1000, 7, 0, 64)])
def test_streaming_virtual_sequence_matches_positions(start, n, sink, local):
    """The past rows streaming_prefix keeps, put before the chunk, give the chunk's Λ attention
    when the mask is computed on virtual indices (what the fresh-sequence kernel does)."""
    gen = torch.Generator().manual_seed(start)
    d = 16
    q = torch.randn(2, n, d, generator=gen)
    k, v = torch.randn(2, start + n, d, generator=gen), torch.randn(2, start + n, d, generator=gen)
    qpos = torch.arange(start, start + n)
    want = masked_attention(q, k, v, lam_mask(qpos, torch.arange(start + n), sink, local), 0.25)
    past = torch.cat([torch.arange(a, b) for a, b in streaming_prefix(start, sink, local)])
    assert len(past) <= max(start, 0) and len(past) <= sink + local or start <= sink + local
    rows = torch.cat((past, qpos))  # virtual sequence: its index i holds position rows[i]
    vidx = torch.arange(len(rows))
    got = masked_attention(q, k[:, rows], v[:, rows], lam_mask(vidx[len(past):], vidx, sink, local), 0.25)
    assert torch.allclose(got, want, atol=1e-10)


@pytest.mark.parametrize("start", [0, 64, 192, 448, 1024])
def test_grid_segments_tile_the_past_in_power_of_two_pieces(start):
    segs = grid_segments(start, 64)
    edges = [0] + [b for _, b in segs]
    assert [a for a, _ in segs] == edges[:-1] and edges[-1] == start
    sizes = [b - a for a, b in segs]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert all(s // 64 & (s // 64 - 1) == 0 for s in sizes) and len(segs) == bin(start // 64).count("1")
    with pytest.raises(ValueError):
        grid_segments(start + 1, 64)


@pytest.mark.parametrize("seed", [0, 1])
def test_dense_chunk_over_past_pieces_equals_one_past(seed):
    """The past given as grid pieces (each its own tensor) gives the attention of the whole past."""
    g = torch.Generator().manual_seed(seed)
    h, group, start, n, d = 2, 4, 448, 37, 32
    q = torch.randn(h * group, n, d, generator=g)
    k, v = (torch.randn(h, start + n, d, generator=g) for _ in "kv")
    whole = dense_chunk(q, k[:, :start], v[:, :start], k[:, start:], v[:, start:], group, d ** -0.5)
    segs = grid_segments(start, 64)
    pieces = dense_chunk(q, [k[:, a:b].clone() for a, b in segs], [v[:, a:b].clone() for a, b in segs],
                         k[:, start:], v[:, start:], group, d ** -0.5)
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)
