"""Unit tests of the two-way paged KV cache building blocks (SPEC.md section 3).

Checks
------
* :class:`PageAllocator`: ids in range and distinct, all-or-nothing allocation, double free.
* :class:`StreamRing`: slot mapping ``sink + (i - sink) % local``, which page each slot holds
  after ``length`` tokens (against a write simulation), and that the ring sized by
  :class:`KVCache` always holds the whole sink + local window.
* INT8 / INT4 quantization round trip: error bounds, packing layout, per-token-per-head scales,
  and the paged pool's write/read path.
* :class:`KeyStats`: channel-wise kmax/kmin per logical page against explicit reductions of the
  raw keys, with writes in uneven chunks and pages reused by a new owner.
"""

from __future__ import annotations

import pytest
import torch

from lserve.cache.allocator import OutOfPages, PageAllocator
from lserve.cache.key_stats import KeyStats
from lserve.cache.kv_cache import KVCache, StreamRing
from lserve.cache.paged_pool import PagedPool
from lserve.cache.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from lserve.config import CacheConfig, ModelConfig


# ----------------------------------------------------------------------------------------------
# PageAllocator
# ----------------------------------------------------------------------------------------------
def test_allocator_hands_out_distinct_ids():
    a = PageAllocator(10)
    assert (a.num_free, a.num_used) == (10, 0)
    x = a.allocate(4)
    y = a.allocate(3)
    assert len(set(x) | set(y)) == 7 and all(0 <= p < 10 for p in x + y)
    assert (a.num_free, a.num_used) == (3, 7)
    assert a.allocate(0) == []
    assert a.can_allocate(3) and not a.can_allocate(4)


def test_allocator_all_or_nothing():
    a = PageAllocator(5)
    a.allocate(3)
    with pytest.raises(OutOfPages):
        a.allocate(3)
    assert a.num_free == 2  # nothing taken by the failed call
    assert len(a.allocate(2)) == 2
    with pytest.raises(OutOfPages):
        a.allocate(1)


def test_allocator_free_and_reuse():
    a = PageAllocator(6)
    x = a.allocate(6)
    a.free(x[1:4])
    assert a.num_free == 3
    y = a.allocate(3)
    assert sorted(y) == sorted(x[1:4])
    a.free(x)
    assert (a.num_free, a.num_used) == (6, 0)
    with pytest.raises(RuntimeError):
        a.free([x[0]])  # double free
    with pytest.raises(RuntimeError):
        PageAllocator(3).free([1])  # never allocated


# ----------------------------------------------------------------------------------------------
# StreamRing
# ----------------------------------------------------------------------------------------------
RINGS = [(0, 1), (0, 3), (1, 2), (2, 3), (3, 1)]


@pytest.mark.parametrize("sink_pages,local_pages", RINGS)
def test_ring_slot_of_page(sink_pages, local_pages):
    ring = StreamRing(8, sink_pages, local_pages)
    i = torch.arange(40)
    expect = [p if p < sink_pages else sink_pages + (p - sink_pages) % local_pages for p in range(40)]
    assert ring.slot_of_page(i).tolist() == expect
    assert ring.num_slots == sink_pages + local_pages


@pytest.mark.parametrize("sink_pages,local_pages", RINGS)
def test_ring_page_in_slot_matches_simulation(sink_pages, local_pages):
    N = 4
    ring = StreamRing(N, sink_pages, local_pages)
    held = [-1] * ring.num_slots
    assert ring.page_in_slot(0) == held
    for length in range(1, 60):
        page = (length - 1) // N  # the page token length-1 is written into
        slot = page if page < sink_pages else sink_pages + (page - sink_pages) % local_pages
        held[slot] = page
        assert ring.page_in_slot(length) == held, length


@pytest.mark.parametrize("sink,local", [(0, 8), (8, 8), (8, 24), (16, 16)])
def test_cache_ring_holds_the_window(sink, local):
    """With KVCache's sizing (local/N + 1 ring pages) every token a streaming query needs is held."""
    N = 8
    m = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                    head_dim=16)
    cache = KVCache(m, CacheConfig(page_size=N, logical_page_size=4, num_pages=4), [1], sink, local, 2,
                    torch.float32, "cpu")
    assert cache.stream_pages_per_seq == sink // N + local // N + 1
    assert cache.stream_alloc.num_pages == 2 * cache.stream_pages_per_seq
    ring = cache.ring
    for length in range(1, 100):
        p = length - 1
        held = {i for i in ring.page_in_slot(length) if i >= 0}
        need = {t // N for t in range(length) if t < sink or p - t < local}
        assert need <= held, (length, need - held)


def test_cache_without_streaming_heads_has_no_ring():
    m = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=2,
                    head_dim=16)
    cache = KVCache(m, CacheConfig(page_size=8, logical_page_size=4, num_pages=4), [2, 2], 8, 16, 3,
                    torch.float32, "cpu")
    assert not cache.has_streaming and cache.stream_pages_per_seq == 0 and cache.stream_alloc.num_pages == 0
    assert cache.pages_for(0) == 0 and cache.pages_for(8) == 1 and cache.pages_for(9) == 2


# ----------------------------------------------------------------------------------------------
# Quantization
# ----------------------------------------------------------------------------------------------
def _x(seed: int, *shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # per-row magnitudes spanning three decades: scales must be per token and head
    return torch.randn(*shape, generator=g) * torch.logspace(-2, 1, shape[-2]).unsqueeze(-1)


def test_int8_round_trip():
    x = _x(0, 5, 7, 32)
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and s.shape == x.shape[:-1] and s.dtype == torch.float32
    torch.testing.assert_close(s, x.abs().amax(-1) / 127)
    y = dequantize_int8(q, s, torch.float32)
    err = (y - x).abs()
    assert (err <= s.unsqueeze(-1) / 2 * (1 + 1e-5)).all()
    # relative to each row's max: 1/254
    assert float((err.amax(-1) / x.abs().amax(-1)).max()) <= 1 / 254 + 1e-6
    assert (q.abs() <= 127).all() and (q.abs().amax(-1) == 127).all()


def test_int4_round_trip_and_layout():
    x = _x(1, 5, 7, 32)
    packed, s, z = quantize_int4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 7, 16)
    lo, hi = x.amin(-1), x.amax(-1)
    torch.testing.assert_close(z, lo)
    torch.testing.assert_close(s, (hi - lo) / 15)
    # element 2i in the low nibble, 2i+1 in the high nibble
    nib = torch.round((x - lo.unsqueeze(-1)) / s.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    assert torch.equal(packed & 0xF, nib[..., 0::2]) and torch.equal(packed >> 4, nib[..., 1::2])
    y = dequantize_int4(packed, s, z, torch.float32)
    err = (y - x).abs()
    assert (err <= s.unsqueeze(-1) / 2 * (1 + 1e-4) + 1e-6).all()
    # the row minimum is exact and the maximum is exact up to float rounding
    torch.testing.assert_close(y.amin(-1), lo)
    torch.testing.assert_close(y.amax(-1), hi)


def test_quant_constant_rows_are_finite():
    x = torch.full((3, 2, 16), 0.75)
    x[1] = -2.0
    y8 = dequantize_int8(*quantize_int8(x), torch.float32)
    y4 = dequantize_int4(*quantize_int4(x), torch.float32)
    assert torch.isfinite(y8).all() and torch.isfinite(y4).all()
    torch.testing.assert_close(y8, x)
    torch.testing.assert_close(y4, x)


def test_quant_rows_independent():
    """Scaling one token's vector leaves every other token's quantization unchanged."""
    x = _x(2, 6, 3, 16)
    x2 = x.clone()
    x2[2, 1] *= 1000
    for f in (lambda t: dequantize_int8(*quantize_int8(t), torch.float32),
              lambda t: dequantize_int4(*quantize_int4(t), torch.float32)):
        a, b = f(x), f(x2)
        keep = torch.ones(6, 3, dtype=torch.bool)
        keep[2, 1] = False
        assert torch.equal(a[keep], b[keep])


@pytest.mark.parametrize("kv_quant", ["none", "int8", "int4"])
def test_paged_pool_write_read(kv_quant):
    P, H, N, D = 5, 3, 8, 16
    pool = PagedPool(P, H, N, D, kv_quant, torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    pages = torch.tensor([4, 4, 4, 1, 1, 3, 0, 0, 0, 0])
    offs = torch.tensor([0, 1, 7, 2, 3, 5, 6, 0, 4, 1])
    k = torch.randn(len(pages), H, D, generator=g)
    v = torch.randn(len(pages), H, D, generator=g)
    pool.write(pages, offs, k, v)
    kr, vr = pool.read(torch.tensor([0, 1, 3, 4]))
    assert kr.shape == (4, H, N, D) and kr.dtype == torch.float32
    slot = {0: 0, 1: 1, 3: 2, 4: 3}

    def expect(x):
        if kv_quant == "none":
            return x
        if kv_quant == "int8":
            return dequantize_int8(*quantize_int8(x), torch.float32)
        return dequantize_int4(*quantize_int4(x), torch.float32)

    ek, ev = expect(k), expect(v)
    for i, (p, o) in enumerate(zip(pages.tolist(), offs.tolist())):
        assert torch.equal(kr[slot[p], :, o], ek[i]) and torch.equal(vr[slot[p], :, o], ev[i])
    if kv_quant != "none":
        bound = 1 / 254 if kv_quant == "int8" else 1 / 30
        for x, y in ((k, ek), (v, ev)):
            rng = (x.amax(-1) - x.amin(-1)) if kv_quant == "int4" else x.abs().amax(-1)
            assert ((y - x).abs().amax(-1) <= rng * bound * (1 + 1e-4)).all()
        # int8 is 4x, int4 8x smaller than fp32 for the data (scales extra)
        shrink = 4 if kv_quant == "int8" else 8
        assert pool.k.numel() * pool.k.element_size() * shrink == P * H * N * D * 4


# ----------------------------------------------------------------------------------------------
# KeyStats
# ----------------------------------------------------------------------------------------------
def _write_stats(stats: KeyStats, pages: list[int], start: int, k: torch.Tensor, N: int) -> None:
    """Write tokens [start, start + len(k)) of a sequence whose page table is ``pages``."""
    pos = torch.arange(start, start + k.shape[0])
    stats.update(torch.tensor(pages)[pos // N], pos % N, k)


def _expected(keys: torch.Tensor, NL: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Explicit channel-wise max/min of each logical page of raw keys [T, H, D]."""
    mx, mn = [], []
    for j in range(-(-keys.shape[0] // NL)):
        blk = keys[j * NL:(j + 1) * NL]
        mx.append(blk.max(dim=0).values)
        mn.append(blk.min(dim=0).values)
    return mx, mn


@pytest.mark.parametrize("N,NL", [(8, 2), (8, 4), (8, 8), (16, 4)])
def test_key_stats_chunked_writes(N, NL):
    H, D, P = 2, 16, 12
    stats = KeyStats(P, H, N, NL, D, torch.float32, "cpu")
    g = torch.Generator().manual_seed(N * 10 + NL)
    pages = [7, 2, 9, 0, 11, 5]
    T = 43
    keys = torch.randn(T, H, D, generator=g)
    t = 0
    for n in (5, 1, 12, 1, 1, 17, 6):  # uneven chunks: logical pages split across calls
        _write_stats(stats, pages, t, keys[t:t + n], N)
        t += n
    assert t == T
    gg = N // NL
    assert stats.kmax.shape == (P, gg, H, D)
    mx, mn = _expected(keys, NL)
    flat_max = stats.kmax.view(P * gg, H, D)
    flat_min = stats.kmin.view(P * gg, H, D)
    for j in range(len(mx)):
        slot = pages[j * NL // N] * gg + (j * NL % N) // NL
        assert torch.equal(flat_max[slot], mx[j]), j
        assert torch.equal(flat_min[slot], mn[j]), j


def test_key_stats_reset_when_page_reused():
    """A new owner's statistics never include the previous owner's keys."""
    N, NL, H, D = 8, 4, 1, 8
    stats = KeyStats(4, H, N, NL, D, torch.float32, "cpu")
    g = torch.Generator().manual_seed(5)
    big = torch.randn(16, H, D, generator=g) * 100
    _write_stats(stats, [3, 1], 0, big, N)  # owner A fills pages 3 and 1 with huge keys
    small = torch.randn(11, H, D, generator=g)
    _write_stats(stats, [1, 3], 0, small[:6], N)  # owner B: 11 tokens, in two writes
    _write_stats(stats, [1, 3], 6, small[6:], N)
    mx, mn = _expected(small, NL)  # 3 logical pages, the last one partial (3 tokens)
    for j, (page, sub) in enumerate([(1, 0), (1, 1), (3, 0)]):
        assert torch.equal(stats.kmax[page, sub], mx[j]) and torch.equal(stats.kmin[page, sub], mn[j])
    assert (stats.kmax[3, 0] < 10).all()


def test_key_stats_decode_appends():
    """Token-by-token appends (decode) give the same statistics as one prefill write."""
    N, NL, H, D = 8, 2, 3, 16
    g = torch.Generator().manual_seed(9)
    keys = torch.randn(21, H, D, generator=g)
    a = KeyStats(4, H, N, NL, D, torch.float32, "cpu")
    b = KeyStats(4, H, N, NL, D, torch.float32, "cpu")
    _write_stats(a, [2, 0, 3], 0, keys, N)
    _write_stats(b, [2, 0, 3], 0, keys[:9], N)
    for t in range(9, 21):
        _write_stats(b, [2, 0, 3], t, keys[t:t + 1], N)
    for p in (2, 0):
        assert torch.equal(a.kmax[p], b.kmax[p]) and torch.equal(a.kmin[p], b.kmin[p])
    assert torch.equal(a.kmax[3, :3], b.kmax[3, :3]) and torch.equal(a.kmin[3, :3], b.kmin[3, :3])


# ----------------------------------------------------------------------------------------------
# StepPlanner write locations
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sink,local", [(0, 16), (8, 24), (16, 8)])
def test_planner_vectorised_writes_match_the_list_path(sink, local):
    """Long steps (prefill chunks) get their (row, page, offset) writes from numpy, short ones from
    Python lists; both give the same locations for any start/length, ring wrap included."""
    import random

    import numpy as np

    from lserve.config import SparsityConfig
    from lserve.sparsity.plan import SeqStep, StepPlanner

    N = 8
    m = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                    head_dim=16)
    cache = KVCache(m, CacheConfig(page_size=N, logical_page_size=4, num_pages=64), [1], sink, local, 2,
                    torch.float32, "cpu")
    planner = StepPlanner(SparsityConfig(pattern="random", sink_tokens=sink, local_tokens=local), cache, "cpu")
    rng = random.Random(7)
    dense = rng.sample(range(64), 40)  # a shuffled page table: page ids unrelated to positions
    ring = cache.stream_alloc.allocate(cache.stream_pages_per_seq)
    for _ in range(40):
        start, n, t = rng.randrange(0, 200), rng.randrange(1, 100), rng.randrange(0, 50)
        s = SeqStep(0, start, n, False, dense, ring)
        by_list = (([], [], []), ([], [], []))
        by_numpy = (([], [], []), ([], [], []))
        planner._writes_py(s, t, start + n, *by_list)
        planner._writes_np(s, t, start + n, *by_numpy)
        for lists, arrays in zip(by_list, by_numpy):
            for lst, arr in zip(lists, arrays):
                got = np.concatenate(arr) if arr else np.zeros(0, np.int64)
                assert got.tolist() == lst, (start, n)
        assert len(by_list[0][0]) == n and len(set(by_list[1][0])) == len(by_list[1][0])  # no ring row twice
