"""Decode KV bytes read vs dense (lserve.sparsity.kv_read): the rule on hand-computed layouts, and
the engine's meter against what the torch backend really gathers."""

from __future__ import annotations

import pytest

from lserve.cache.kv_cache import StreamRing
from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.sparsity.kv_read import KVReadMeter, ring_tokens, selected_tokens, step_read


def test_step_read_by_hand():
    # 2 layers, 2 KV heads; layer 0 all dense, layer 1 one dense + one streaming head reading 300 tokens.
    assert step_read([2, 1], 2, 1000, 300, [None, None]) == (2000 + 1000 + 300, 4000)
    # layer 1 selects: its dense head reads 256 tokens
    assert step_read([2, 1], 2, 1000, 300, [None, 256]) == (2000 + 256 + 300, 4000)
    # None: no layer selects, the same as None in every layer
    assert step_read([2, 1], 2, 1000, 300, None) == step_read([2, 1], 2, 1000, 300, [None, None])
    # every head streaming, context shorter than the ring: all of it
    assert step_read([0, 0], 2, 100, 100, [None, None]) == (400, 400)
    # a selection larger than the context reads the context
    assert step_read([1], 1, 100, 0, [4096]) == (100, 100)
    with pytest.raises(ValueError):
        step_read([1, 1], 1, 100, 0, [None])  # one entry per layer


def test_selected_tokens_by_hand():
    # 1000 tokens in 16 pages of 64; K = 4: 3 chosen full pages + the last page's 40 tokens.
    assert selected_tokens(1000, 64, 4, 16) == 3 * 64 + 40
    # 30 tokens later the selection is reused: the then-last page (15) and the new page 16 are read
    assert selected_tokens(1030, 64, 4, 16) == 3 * 64 + (1030 - 15 * 64)
    # query mode: each of 3 query heads chooses its own 3 pages (union bound)
    assert selected_tokens(1000, 64, 4, 16, group=3) == 9 * 64 + 40
    assert selected_tokens(200, 64, 4, 4, group=3) == 200


def test_ring_tokens_by_hand():
    ring = StreamRing(page_size=64, sink_pages=1, local_pages=2)
    slots = ring.page_in_slot(300)  # pages 0 (sink), 3 and 4 (ring)
    assert sorted(slots) == [0, 3, 4]
    assert ring_tokens(slots, 300, 64) == 64 + 64 + 44
    assert ring_tokens(ring.page_in_slot(50), 50, 64) == 50


def test_meter_totals_per_sequence_and_after_release():
    m = KVReadMeter(keep=1)
    m.begin_step()
    m.add(1, 10, 40)
    m.add(2, 20, 40)
    assert (m.total.read, m.total.dense, m.total.steps) == (30, 80, 2)
    assert m.last_step.fraction == pytest.approx(30 / 80)
    m.release(1)
    m.add(1, 5, 10)  # a preempted sequence decodes again: its totals continue
    assert (m.of(1).read, m.of(1).steps) == (15, 2)
    m.release(1)
    m.release(2)  # keep=1: sequence 1's entry is dropped
    assert m.of(1) is None and m.pop(2).fraction == pytest.approx(0.5) and m.of(2) is None


def _counting_backend(be):
    """Wrap the torch backend's decode to count the head-tokens it reads (independently of the rule)."""
    counted = {"read": 0}
    cache, N = be.cache, be.cache.page_size
    H = be.model.num_kv_heads
    inner_decode, inner_table = be._decode, be._page_table
    state = {}

    def page_table(layer, sp, qd, *k):
        table = inner_table(layer, sp, qd, *k)  # [H_sel, C] indices into sp.pages
        state["table"] = table
        return table

    def decode(layer, sp, q):
        state.pop("table", None)
        out = inner_decode(layer, sp, q)
        nd = cache.n_dense[layer]
        table = state.get("table")
        if nd and table is not None:
            first = table * N  # first position of each read page
            counted["read"] += int((sp.length - first).clamp(min=0, max=N).sum())
        elif nd:
            counted["read"] += nd * sp.length
        if H - nd:
            _, _, pos = be._ring_kv(layer, sp)
            counted["read"] += (H - nd) * int((pos < sp.length).sum())
        return out

    be._decode, be._page_table = decode, page_table
    return counted


@pytest.mark.parametrize("mode", ["kv", "dense"])
def test_meter_equals_what_the_torch_backend_reads(smol, mode):
    if mode == "dense":
        sp = SparsityConfig(pattern=None, token_budget=0)
    else:  # streaming heads, selection in some layers, reuse across page boundaries
        sp = SparsityConfig(pattern="random", static_sparsity=0.5, sink_tokens=16, local_tokens=32, token_budget=64,
                            reuse_interval=3, dynamic_threshold=0, select_layers=(1, 4, 7, 20))
    eng = LLMEngine(EngineConfig(model="default", sparsity=sp, max_num_seqs=2, max_batched_tokens=512,
                                 cache=CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=2048)), smol)
    counted = _counting_backend(eng.backend)
    prompts = ["The quick brown fox jumps over the lazy dog. " * 12, "Count: one two three four five six seven."]
    outs = eng.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    total = eng.stats().kv_read
    assert total.steps == 2 * 23 and total.read == counted["read"]
    if mode == "dense":
        assert total.read == total.dense
    else:
        assert 0 < total.read < total.dense
    # per-sequence totals (kept after the requests finished) add up to the engine's
    seqs = [eng.backend.kv_read.pop(int(o.request_id.split("-")[1])) for o in outs]
    assert sum(s.read for s in seqs) == total.read and sum(s.dense for s in seqs) == total.dense
