"""Prefix cache: greedy outputs equal with and without it, sharing, eviction, collisions, opt-out.

Engines here use 16-token pages and a 16 + 32 streaming window, so the 88-token shared prefix
spans many pages and the ring of a hit (sink + local window) must be filled from the shadows.
"""

from __future__ import annotations

import pytest
from chunk_ends import chunks_end_at

from lserve.cache.allocator import OutOfPages, PageAllocator
from lserve.cache.prefix_cache import PrefixCache
from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams

DOC = " ".join(f"Box {i} is {['red', 'blue', 'green', 'black'][i % 4]}." for i in range(14))
QUESTIONS = [" Q: what colour is box 5? A:", " Q: which box is black? A:"]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
CONFIGS = {
    "dense": SparsityConfig(pattern=None, token_budget=0),
    "static": SparsityConfig(pattern="random", static_sparsity=0.5, sink_tokens=16, local_tokens=32, token_budget=0),
    "lserve": SparsityConfig(pattern="random", static_sparsity=0.5, sink_tokens=16, local_tokens=32, token_budget=48,
                             reuse_interval=2, dynamic_threshold=0),
}


def _engine(smol, prefix_cache: bool, sparsity: str = "lserve", kv_quant: str = "none", dtype: str = "float32",
            **kw) -> LLMEngine:
    kw.setdefault("cache", CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=2048, kv_quant=kv_quant))
    return LLMEngine(EngineConfig(model="default", sparsity=CONFIGS[sparsity], dtype=dtype, prefix_cache=prefix_cache,
                                  **kw), smol)


def _one_by_one(engine: LLMEngine, prompts: list[str], params: SamplingParams = GREEDY):
    return [engine.generate([p], params)[0] for p in prompts]


@pytest.mark.parametrize("sparsity,kv_quant,dtype", [
    ("dense", "none", "float32"), ("static", "int8", "float32"), ("lserve", "none", "float32"),
    ("lserve", "int4", "float32"), ("lserve", "none", "bfloat16"),
])
def test_greedy_outputs_equal_with_and_without_cache(smol, sparsity, kv_quant, dtype):
    prompts = [DOC + q for q in QUESTIONS]
    cached = _one_by_one(_engine(smol, True, sparsity, kv_quant, dtype), prompts)
    hits = [o.metrics["cached_tokens"] for o in cached]
    assert hits[0] == 0 and all(h >= 80 and h % 16 == 0 for h in hits[1:])
    plain_engine = _engine(smol, False, sparsity, kv_quant, dtype)
    plain = _one_by_one(plain_engine, prompts[:1])
    if kv_quant != "none" or dtype != "float32":
        # Quantized or bf16 K/V make a prompt's outputs depend on where its chunks end (a chunk
        # attends to its own K/V exactly, to earlier chunks' through the cache): the uncached run
        # of a follow-up ends a chunk where the cached one resumed.
        chunks_end_at(plain_engine, sorted(set(hits[1:])))
    plain += _one_by_one(plain_engine, prompts[1:])
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert all(o.metrics["cached_tokens"] == 0 for o in plain)


def test_partial_page_prefix_reuses_only_full_pages(smol):
    # Shared prefix of 16k + 7 tokens: the page holding the divergence is recomputed.
    eng = _engine(smol, True)
    ids = eng.encode_prompt(DOC)
    shared = ids[: 16 * 3 + 7]
    a, b = shared + ids[60:80], shared + ids[20:40]
    outs = [eng.generate([p], GREEDY)[0] for p in (a, b)]
    assert outs[1].metrics["cached_tokens"] == 16 * 3
    plain = _engine(smol, False)
    assert [o.token_ids for o in outs] == [plain.generate([p], GREEDY)[0].token_ids for p in (a, b)]


def test_whole_prompt_cached_still_computes_its_last_token(smol):
    eng = _engine(smol, True)
    ids = eng.encode_prompt(DOC)[:80]  # exactly 5 pages
    first, second = (eng.generate([ids], GREEDY)[0] for _ in range(2))
    assert second.metrics["cached_tokens"] == 64  # the last page holds the token that gives logits
    assert second.token_ids == first.token_ids


def test_prefix_shared_by_concurrent_requests(smol):
    eng = _engine(smol, True, max_batched_tokens=128)
    prompts = [DOC + q for q in QUESTIONS]
    rids = [eng.add_request(prompts[0], GREEDY)]
    while not eng.scheduler.running or eng.scheduler.running[0].num_computed < 64:
        eng.step()
    for p in prompts[1:]:  # while the first one still runs
        rids.append(eng.add_request(p, GREEDY))
    eng.step()
    seqs = {s.request_id: s for s in eng.scheduler.running}
    first = seqs[rids[0]]
    later = [seqs[r] for r in rids[1:]]
    assert all(s.num_cached_tokens >= 64 for s in later)
    shared = first.dense_pages[0]
    assert all(s.dense_pages[0] == shared for s in later)
    assert eng.cache.prefix._by_page[shared].refs == 2
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o.token_ids
    plain = _one_by_one(_engine(smol, False), prompts)
    assert [final[r] for r in rids] == [o.token_ids for o in plain]
    assert eng.cache.all_free() and eng.stats().prefix_cached_pages > 0


def test_request_arriving_with_its_prefix_in_flight_waits_for_it(smol):
    # Both arrive together; chunks of <= 48 tokens: the second waits for the first's pages.
    eng = _engine(smol, True, max_batched_tokens=48)
    prompts = [DOC + q for q in QUESTIONS]
    outs = eng.generate(prompts, GREEDY)
    first, second = sorted(o.metrics["cached_tokens"] for o in outs)  # shortest remaining goes first
    assert first == 0 and second >= 80
    plain = _one_by_one(_engine(smol, False), prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_abort_and_preemption_never_free_a_page_another_sequence_reads(smol):
    # 12 pages of 16 tokens: three ~100-token prompts (7 pages, the first 5 or 6 shared) fit, but
    # not once each grows to ~119 tokens (8 pages).
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = [DOC + q for q in QUESTIONS + [" Q: name a red box. A:"]]
    eng = _engine(smol, True, cache=CacheConfig(page_size=16, logical_page_size=4, num_pages=12))
    eng.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0))  # leaves the prefix cached
    outs = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    plain = LLMEngine(EngineConfig(model="default", sparsity=CONFIGS["lserve"], prefix_cache=False,
                                   cache=CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=2048)), smol)
    assert [o.token_ids for o in outs] == [o.token_ids for o in _one_by_one(plain, prompts, params)]
    assert eng.cache.all_free()
    # Abort one of two readers of a cached prefix: the other one's pages stay held and correct.
    a = eng.add_request(prompts[1], params)
    b = eng.add_request(prompts[2], params)
    eng.step()
    sa, sb = (next(s for s in eng.scheduler.running if s.request_id == r) for r in (a, b))
    shared = set(sa.dense_pages) & set(sb.dense_pages)
    assert shared
    eng.abort(a)
    assert not shared & set(eng.cache.dense_alloc._free)
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = o
    assert out[b].token_ids == outs[2].token_ids


def test_cache_full_evicts_lru_and_never_fails(smol):
    # 8 pages hold one ~100-token request: every new document evicts the previous one's pages.
    eng = _engine(smol, True, cache=CacheConfig(page_size=16, logical_page_size=4, num_pages=8))
    docs = [DOC, DOC.replace("Box", "Crate"), DOC.replace("Box", "Bin")]
    outs = [eng.generate([d + QUESTIONS[0]], GREEDY)[0] for d in docs + docs[:1]]
    assert eng.stats().prefix_evictions > 0
    assert all(o.metrics["cached_tokens"] == 0 for o in outs)  # each evicted before it came back
    assert outs[3].token_ids == outs[0].token_ids
    # The most recent document is still cached.
    again = eng.generate([docs[0] + QUESTIONS[1]], GREEDY)[0]
    assert again.metrics["cached_tokens"] >= 64


def test_hash_collision_never_serves_another_prompts_kv(smol, monkeypatch):
    monkeypatch.setattr(PrefixCache, "hashes", lambda self, tokens, max_pages=None: [7] * (len(tokens) // 16))
    eng = _engine(smol, True)
    a, b = DOC + QUESTIONS[0], DOC.replace("Box", "Crate") + QUESTIONS[0]
    outs = [eng.generate([p], GREEDY)[0] for p in (a, b, a)]
    assert outs[1].metrics["cached_tokens"] == 0  # every page "hits" the index; token ids differ
    plain = _engine(smol, False)
    expect = [plain.generate([p], GREEDY)[0].token_ids for p in (a, b)]
    assert [o.token_ids for o in outs] == expect + expect[:1]


def test_opt_out_and_prompt_logprobs_skip_the_cache(smol):
    eng = _engine(smol, True)
    p = DOC + QUESTIONS[0]
    off = SamplingParams(max_tokens=2, temperature=0, prefix_cache=False)
    eng.generate([p], off)
    assert eng.stats().prefix_cached_pages == 0  # an opted-out request leaves nothing behind
    eng.generate([p], GREEDY)
    assert eng.generate([p], off)[0].metrics["cached_tokens"] == 0
    scored = eng.generate([p], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert scored.metrics["cached_tokens"] == 0 and len(scored.prompt_logprobs) == len(scored.prompt_token_ids)
    st = eng.stats()
    assert st.prefix_cache_hits == 0 and st.prefix_cache_queries == len(scored.prompt_token_ids)  # GREEDY's only
    hit = eng.generate([p], GREEDY)[0].metrics["cached_tokens"]
    st = eng.stats()
    assert hit > 0 and st.prefix_cache_hits == hit and st.prefix_cache_queries == 2 * len(scored.prompt_token_ids)


def test_no_prefix_cache_flag_turns_it_off(smol):
    from lserve.cli import build_parser
    from lserve.config import engine_config_from_args

    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["generate", "hi"])).prefix_cache is True
    assert engine_config_from_args(parser.parse_args(["generate", "hi", "--no-prefix-cache"])).prefix_cache is False
    eng = _engine(smol, False)
    assert not eng.cache.prefix.enabled and eng.cache.shadow_base is None  # no shadow pages either
    out = eng.generate([DOC], GREEDY)[0]
    assert out.metrics["cached_tokens"] == 0 and eng.stats().prefix_cached_pages == 0


def test_index_refcounts_and_lru_order():
    alloc = PageAllocator(6)
    pc = PrefixCache(alloc, page_size=2, seed=b"s")
    toks = [1, 2, 3, 4, 5, 6]
    pages = alloc.allocate(3)
    hs = pc.hashes(toks)
    pc.insert(toks, hs, pages, 0, None)
    assert [e.page for e in pc.match(toks, hs, 3)] == pages
    assert pc.match([1, 2, 3, 9, 5, 6], pc.hashes([1, 2, 3, 9, 5, 6]), 3)[-1].page == pages[0]
    pc.release(pages)
    assert (alloc.num_used, alloc.num_free, pc.num_evictable) == (0, 6, 3)
    held = pc.acquire(pc.match(toks, hs, 1))  # a reader of page 0 only
    got = alloc.allocate(5)  # 3 free + 2 evicted: the tail pages first
    assert pages[0] not in got and set(pages[1:]) <= set(got)
    assert pc.match(toks, hs, 3) == [pc._by_page[held[0]]]
    with pytest.raises(OutOfPages):
        alloc.allocate(1)  # the referenced page is never evicted
    pc.release(held)
    assert alloc.allocate(1) == held  # now idle: evicted on demand
    assert pc.match(toks, hs, 3) == [] and pc.stats.evictions == 3
