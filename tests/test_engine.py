"""Engine behaviour: continuous batching, chunked prefill, preemption, aborts, sampling, errors."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import pytest

from lserve.config import CacheConfig, ConfigError, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, RequestError, SamplingParams
from lserve.engine.async_engine import AsyncEngine, EngineDeadError

PROMPTS = [
    "The capital of France is",
    "List three colours of the rainbow:",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox",
    "In 1969, the first humans",
    "Water boils at",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SMALL_PAGES = CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=4096)
# Sparsity on everywhere it can bite at these lengths: random streaming heads and a tiny budget.
SPARSE = SparsityConfig(pattern="random", static_sparsity=0.5, sink_tokens=16, local_tokens=16,
                        token_budget=32, reuse_interval=2)


def _engine(smol, **kw) -> LLMEngine:
    kw.setdefault("cache", SMALL_PAGES)
    return LLMEngine(EngineConfig(model="default", **kw), smol)


def _one_by_one(smol, prompts, params, **kw):
    eng = _engine(smol, **kw)
    return [eng.generate([p], params)[0].token_ids for p in prompts]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_concurrent_equals_one_by_one(smol, sparse):
    kw = {"sparsity": SPARSE} if sparse else {}
    alone = _one_by_one(smol, PROMPTS, GREEDY, **kw)
    # Small steps force chunked prefill interleaved with decodes of other requests.
    eng = _engine(smol, max_batched_tokens=24, max_num_seqs=5, **kw)
    together = [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]
    assert together == alone
    assert eng.cache.all_free()


def test_preemption_recomputes_same_greedy_tokens(smol):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = _one_by_one(smol, PROMPTS[:6], params)
    # 12 pages of 16 tokens cannot hold six growing sequences: the newest get preempted.
    eng = _engine(smol, cache=CacheConfig(page_size=16, logical_page_size=4, num_pages=12))
    outs = eng.generate(PROMPTS[:6], params)
    assert eng.scheduler.num_preemptions > 0
    assert any(o.metrics["num_preemptions"] for o in outs)
    assert [o.token_ids for o in outs] == alone
    assert eng.cache.all_free()


def test_abort_frees_pages_immediately(smol):
    eng = _engine(smol, sparsity=SPARSE)
    rids = [eng.add_request(p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)) for p in PROMPTS]
    for _ in range(3):
        eng.step()
    assert eng.cache.dense_alloc.num_used > 0 and eng.cache.stream_alloc.num_used > 0
    for rid in rids[::2]:
        assert eng.abort(rid)
    assert not eng.abort("no-such-request")
    while eng.has_unfinished():
        eng.step()
    assert eng.cache.all_free()
    assert not eng.backend.planner._decode_steps  # per-sequence state dropped too


def test_sampling_seed_top_k_and_stops(smol):
    eng = _engine(smol)
    p = "Write a short poem about the sea:"
    s1 = eng.generate([p], SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))[0]
    s2 = eng.generate([p], SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert s1.token_ids == s2.token_ids
    greedy = eng.generate([p], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    topk1 = eng.generate([p], SamplingParams(max_tokens=16, temperature=0.8, top_k=1, seed=1, ignore_eos=True))[0]
    assert topk1.token_ids == greedy.token_ids
    tiny_p = eng.generate([p], SamplingParams(max_tokens=16, temperature=0.8, top_p=1e-6, seed=3, ignore_eos=True))[0]
    assert tiny_p.token_ids == greedy.token_ids
    # A stop string cuts the text before it and ends the request.
    full = eng.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0))[0]
    word = full.text.split()[1]
    cut = eng.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0, stop=[word]))[0]
    assert cut.finish_reason == "stop" and word not in cut.text and full.text.startswith(cut.text)
    # A stop token id ends it too.
    first = full.token_ids[1]
    st = eng.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[first]))[0]
    assert st.finish_reason == "stop" and st.token_ids == full.token_ids[:2]
    assert full.finish_reason in ("length", "stop")


def test_request_errors_are_clear(smol):
    eng = _engine(smol, max_model_len=256)
    with pytest.raises(RequestError, match="maximum context length is 256 tokens.*300 in the prompt"):
        eng.add_request(list(range(300)), SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.add_request([10**9], SamplingParams())
    with pytest.raises(RequestError, match="top_p") as e:
        SamplingParams(top_p=0)
    assert e.value.param == "top_p"
    # the per-request token budget: 0 or at least two pages (of 16 tokens here), at most the context
    with pytest.raises(RequestError, match=r"at least two KV pages \(32 tokens\), got 20") as e:
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, token_budget=20))
    assert e.value.param == "token_budget"
    with pytest.raises(RequestError, match=r"token_budget \(512\) exceeds the model's context length \(256\)") as e:
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, token_budget=512))
    assert e.value.param == "token_budget"
    with pytest.raises(RequestError, match="token_budget must be an integer >= 0"):
        SamplingParams(token_budget=-1)
    with pytest.raises(ConfigError, match="multiples of the page size"):
        EngineConfig(sparsity=SparsityConfig(sink_tokens=10))
    assert not eng.has_unfinished() and eng.cache.all_free()


def test_async_engine_warms_up_in_the_thread_that_steps(smol, monkeypatch):
    """The warm-up (cuDNN's plans on a GPU, kept per thread by PyTorch) runs in the engine loop's
    thread before the constructor returns; a failing warm-up fails the constructor."""
    import threading

    seen = []
    monkeypatch.setattr(LLMEngine, "warm_up", lambda self: seen.append(threading.current_thread().name) or 0.0)
    engine = AsyncEngine(EngineConfig(model="default", cache=SMALL_PAGES), loaded=smol)
    try:
        assert seen == ["lserve-engine"]
        out = asyncio.run(_last(engine.generate("Hi", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))))
        assert out.finished and len(out.token_ids) == 2
    finally:
        engine.shutdown()

    def fail(self):
        raise RuntimeError("no plans")

    monkeypatch.setattr(LLMEngine, "warm_up", fail)
    with pytest.raises(RuntimeError, match="no plans"):
        AsyncEngine(EngineConfig(model="default", cache=SMALL_PAGES), loaded=smol)


async def _last(stream):
    outs = [out async for out in stream]
    return outs[-1]


def test_async_engine_coalesces_what_a_slow_consumer_missed(smol):
    """A consumer that falls behind gets one snapshot per read holding every token since the last
    read (text, ids and logprobs in order), not a backlog of per-token snapshots."""
    engine = AsyncEngine(EngineConfig(model="default", cache=SMALL_PAGES), loaded=smol)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)

    async def main():
        outs = []
        async for out in engine.generate("Tell me a story about a fox:", params):
            outs.append(out)
            await asyncio.sleep(0.3)  # slower than a decode step of this model on the CPU
        return outs

    try:
        outs = asyncio.run(main())
        final = outs[-1]
        assert final.finished and len(final.token_ids) == 24
        assert len(outs) < 24  # merged, not one item per token
        assert any(len(o.delta_token_ids) > 1 for o in outs)
        assert [t for o in outs for t in o.delta_token_ids] == final.token_ids
        assert "".join(o.delta_text for o in outs) == final.text
        assert [lp for o in outs for lp in o.delta_logprobs] == final.logprobs
    finally:
        engine.shutdown()


def test_async_engine_delivers_queued_snapshots_before_a_death(smol):
    """Tokens that queued up for a busy consumer when the engine died still reach it, merged,
    before the error (nothing is dropped for the error queued behind them)."""
    engine = AsyncEngine(EngineConfig(model="default", cache=SMALL_PAGES), loaded=smol)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        agen = engine.generate("Tell me a long story:", params)
        first = await agen.__anext__()
        steps0 = engine.stats().steps
        while engine.stats().steps < steps0 + 3:  # blocks the event loop, as a busy consumer does
            time.sleep(0.01)
        engine.kill()
        engine.shutdown()  # the loop has stopped: its last outputs and the error are on their way
        backlog = await agen.__anext__()
        with pytest.raises(Exception, match="dead"):
            await agen.__anext__()
        return first, backlog

    first, backlog = asyncio.run(main())
    assert len(first.delta_token_ids) == 1 and len(backlog.delta_token_ids) >= 3 and not backlog.finished
    assert first.token_ids + backlog.delta_token_ids == backlog.token_ids


def test_async_engine_streams_and_abort_on_close(smol):
    engine = AsyncEngine(EngineConfig(model="default", cache=SMALL_PAGES), loaded=smol)

    async def main():
        pieces = []
        async for out in engine.generate("The capital of France is", GREEDY):
            pieces.append(out.delta_text)
        final = out
        agen = engine.generate("Tell me a long story:", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        async for _ in agen:
            break
        await agen.aclose()  # a client going away
        for _ in range(100):
            if engine.stats().running == 0:
                break
            await asyncio.sleep(0.02)
        return pieces, final

    try:
        pieces, final = asyncio.run(main())
        assert "".join(pieces) == final.text and final.finished and len(final.token_ids) == 12
        assert engine.stats().running == 0 and engine.engine.cache.all_free() and engine.aborted == 1
        engine.kill()
        with pytest.raises(Exception, match="dead"):
            engine.check_health()
    finally:
        engine.shutdown()


def test_a_dropped_engine_is_freed_at_once(smol):
    """Nothing an engine owns refers back to it, nor does a stream that ended in the engine's death:
    dropping the last reference frees the KV pool and weight copies at once, not whenever the cyclic
    GC next runs (it counts objects, not bytes: an engine left per test filled a 24 GiB machine)."""
    gc.collect()
    gc.disable()
    try:
        eng = _engine(smol, sparsity=SPARSE)
        eng.generate(PROMPTS[:2], GREEDY)
        freed = weakref.ref(eng)
        del eng
        assert freed() is None
        engine = AsyncEngine(EngineConfig(model="default", cache=SMALL_PAGES), loaded=smol)

        async def main(engine):
            agen = engine.generate("Tell me a long story:", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
            await agen.__anext__()
            engine.kill()
            with pytest.raises(EngineDeadError):
                async for _ in agen:
                    pass

        asyncio.run(main(engine))
        engine.shutdown()
        freed = weakref.ref(engine)
        del engine
        assert freed() is None
    finally:
        gc.enable()


def test_an_engine_that_loads_its_model_keeps_no_checkpoint_copies(monkeypatch):
    """The model fuses q/k/v, gate/up and o into copies of its own: an engine that loaded the
    checkpoint drops it (on a GPU, Llama-3-8B's originals were 9.5 GiB kept for nothing); one
    handed a loaded model leaves the caller's weights alone."""
    import lserve.engine.llm_engine as le

    seen = {}

    def load(*a, **kw):
        loaded = real(*a, **kw)
        seen["q"] = weakref.ref(loaded.weights["model.layers.0.self_attn.q_proj.weight"])
        seen["gate"] = weakref.ref(loaded.weights["model.layers.0.mlp.gate_proj.weight"])
        return loaded

    real = le.load_model
    monkeypatch.setattr(le, "load_model", load)
    cfg = EngineConfig(model="tiny", cache=SMALL_PAGES)
    eng = LLMEngine(cfg)
    gc.collect()
    assert eng.loaded.weights == {} and seen["q"]() is None and seen["gate"]() is None
    assert eng.loaded.config.name and eng.tokenizer is eng.loaded.tokenizer
    ids = eng.generate([[1, 2, 3, 4]], GREEDY)[0].token_ids
    shared = real("tiny")
    again = LLMEngine(cfg, shared)
    assert again.loaded is shared and len(shared.weights) > 10
    assert again.generate([[1, 2, 3, 4]], GREEDY)[0].token_ids == ids  # same seed, same weights


def test_sequence_tokens_slices_prompt_and_output():
    """Token ranges inside the prompt, across its end and inside the output (decode steps read
    the output alone, without copying the prompt)."""
    from lserve.engine.sequence import Sequence

    s = Sequence(0, "r", list(range(10)), SamplingParams())
    s.output_ids += [100, 101, 102]
    every = list(range(10)) + [100, 101, 102]
    for a in range(14):
        for b in range(a, 14):
            assert s.tokens(a, b) == every[a:b], (a, b)
