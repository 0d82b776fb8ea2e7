"""Async decode (step t+1 launched before step t's tokens are read): same outputs as the
synchronous engine in every situation that drains or discards, and the overlap really happens."""

from __future__ import annotations

import pytest
import torch

from lserve.cli import build_parser, engine_config_from_args
from lserve.config import CacheConfig, ConfigError, EngineConfig
from lserve.engine import LLMEngine, SamplingParams

PROMPTS = ["hello world", "abc", "the quick brown fox jumps", "zz", "Once upon a time"]
PAGES = CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=4096)


@pytest.fixture(scope="module")
def tiny():
    from lserve.models.loader import load_model

    return load_model("tiny")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small steps: one intra-op thread is faster than two fighting other jobs for 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _engine(tiny, async_decode: bool, **kw) -> LLMEngine:
    kw.setdefault("cache", PAGES)
    return LLMEngine(EngineConfig(model="tiny", max_model_len=4096, async_decode=async_decode, **kw), tiny)


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def _run(eng: LLMEngine, prompts, params, on_step=None) -> tuple[list, list, int]:
    """Drive ``step()`` by hand: (final outputs in prompt order, per-call outputs, chained steps).
    ``on_step(i, eng, rids)`` runs before call ``i`` (adds, aborts)."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, plist)]
    final, calls, chained, i = {}, [], 0, 0
    while eng.has_unfinished():
        if on_step:
            on_step(i, eng, rids)
        outs = eng.step()
        chained += bool(outs) and eng.last_step_info["chained"]
        calls.append([(o.request_id, o.delta_token_ids, o.delta_text, o.finish_reason) for o in outs])
        final.update((o.request_id, (o.token_ids, o.text, o.finish_reason)) for o in outs if o.finished)
        i += 1
    assert eng.cache.all_free()
    assert not eng.backend.planner._decode_steps
    assert eng._pending is None or not eng._pending.live()
    return [final.get(r) for r in rids], calls, chained


def _both(tiny, prompts, params, on_step=None, **kw):
    sync = _run(_engine(tiny, False, **kw), prompts, params, on_step)
    fast = _run(_engine(tiny, True, **kw), prompts, params, on_step)
    return sync, fast


def test_staggered_max_tokens_same_outputs_and_steps(tiny):
    params = [_greedy(m) for m in (3, 9, 1, 14, 6)]
    (s_final, s_calls, s_chained), (a_final, a_calls, a_chained) = _both(tiny, PROMPTS, params)
    assert a_final == s_final and all(f[2] == "length" for f in a_final)
    assert [len(f[0]) for f in a_final] == [3, 9, 1, 14, 6]
    assert a_calls == s_calls  # the same outputs from the same step() calls, in the same order
    assert s_chained == 0 and a_chained >= 10


def test_eos_mid_batch_discards_the_wasted_row(tiny):
    params = _greedy(16)
    (plain, _, _), _ = _both(tiny, PROMPTS, params)
    eos = plain[1][0][4]  # a token the model emits mid-sequence: an EOS there ends it early
    eng = _engine(tiny, True)
    eng.eos_ids = (eos,)
    ref = _engine(tiny, False)
    ref.eos_ids = (eos,)
    s_final, s_calls, _ = _run(ref, PROMPTS, params)
    a_final, a_calls, a_chained = _run(eng, PROMPTS, params)
    assert a_final == s_final and a_calls == s_calls and a_chained > 0
    assert s_final[1][2] == "stop" and len(s_final[1][0]) <= 5
    assert any(f[2] == "length" for f in s_final)  # others go on after the early stop
    assert eng.generation_tokens == ref.generation_tokens  # discarded rows are not counted


def test_stop_strings(tiny):
    (plain, _, _), _ = _both(tiny, PROMPTS, _greedy(16))
    text = plain[3][1]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop
    params = _greedy(16, stop=[stop])
    (s_final, s_calls, _), (a_final, a_calls, a_chained) = _both(tiny, PROMPTS, params)
    assert a_final == s_final and a_calls == s_calls and a_chained > 0
    assert s_final[3][2] == "stop" and stop not in s_final[3][1]


def test_abort_while_a_step_is_pending(tiny):
    seen = []

    def abort_some(i, eng, rids):
        if i == 4:
            seen.append(eng._pending is not None and bool(eng._pending.live()))
            assert eng.abort(rids[0]) and eng.abort(rids[3])

    (s_final, s_calls, _), (a_final, a_calls, _) = _both(tiny, PROMPTS, _greedy(12), abort_some)
    assert seen == [False, True]  # the sync engine first, then the async one with a step in flight
    assert a_final == s_final and a_calls == s_calls
    assert a_final[0] is None and a_final[3] is None and all(a_final[i] for i in (1, 2, 4))


def test_abort_everything_pending_then_new_work(tiny):
    eng = _engine(tiny, True)
    rids = [eng.add_request(p, _greedy(20)) for p in PROMPTS[:2]]
    for _ in range(4):
        eng.step()
    assert eng._pending is not None
    for r in rids:
        assert eng.abort(r)
    assert not eng.has_unfinished() and eng.cache.all_free()
    out = eng.generate([PROMPTS[2]], _greedy(5))[0]  # the dead pending step is dropped
    assert out.token_ids == _engine(tiny, False).generate([PROMPTS[2]], _greedy(5))[0].token_ids


def test_new_request_mid_decode_drains_then_continues(tiny):
    def arrive(i, eng, rids):
        if i == 5:
            rids.append(eng.add_request("a late arrival", _greedy(7)))

    (s_final, _, _), (a_final, a_calls, a_chained) = _both(tiny, PROMPTS[:3], _greedy(14), arrive)
    assert a_final == s_final and len(a_final) == 4
    assert a_final[3][0] == _engine(tiny, False).generate(["a late arrival"], _greedy(7))[0].token_ids
    first_late = next(i for i, c in enumerate(a_calls) if any(o[0] == "req-3" for o in c))
    assert all(len(c) == 3 for c in a_calls[1:first_late])  # the step in flight drained first
    assert a_chained > 0


def test_mixed_greedy_and_sampled_falls_back(tiny):
    params = [_greedy(10), SamplingParams(max_tokens=10, temperature=0.8, seed=3), _greedy(10)]
    (s_final, s_calls, _), (a_final, a_calls, a_chained) = _both(tiny, PROMPTS[:3], params)
    assert a_final == s_final and a_calls == s_calls
    assert a_chained == 0


def test_preemption_pressure(tiny):
    cache = CacheConfig(page_size=16, logical_page_size=4, num_pages=10)
    params = _greedy(40)
    alone = [_engine(tiny, False).generate([p], params)[0].token_ids for p in PROMPTS]
    engines = [_engine(tiny, a, cache=cache) for a in (False, True)]
    (s_final, s_calls, _), (a_final, a_calls, a_chained) = [_run(e, PROMPTS, params) for e in engines]
    assert engines[0].scheduler.num_preemptions > 0
    assert engines[1].scheduler.num_preemptions == engines[0].scheduler.num_preemptions
    assert a_final == s_final and [f[0] for f in a_final] == alone
    assert a_calls == s_calls and a_chained > 0


@pytest.mark.parametrize("async_decode", [False, True])
def test_tokens_are_read_after_the_next_step_is_launched(tiny, async_decode):
    """The overlap itself: when the host reads a decode step's tokens, the next step's forward
    has already been launched (two forwards ahead of the reads, not one)."""
    eng = _engine(tiny, async_decode)
    log = []
    forward, read = eng.model.forward, eng._host_tokens.read

    def spy_forward(*a, **k):
        log.append("launch")
        return forward(*a, **k)

    def spy_read(fetch):
        log.append("read")
        return read(fetch)

    eng.model.forward, eng._host_tokens.read = spy_forward, spy_read
    eng.generate(PROMPTS[:3], _greedy(12))
    ahead, launched = [], 0
    for ev in log:
        launched += ev == "launch"
        if ev == "read":
            ahead.append(launched - (len(ahead) + 1))  # forwards launched beyond the one being read
    if async_decode:
        assert ahead.count(1) >= 9 and set(ahead) <= {0, 1}
    else:
        assert set(ahead) == {0}


def test_config_and_cli_flag():
    assert EngineConfig().async_decode is True
    with pytest.raises(ConfigError, match="async_decode"):
        EngineConfig(async_decode="no")
    p = build_parser()
    assert engine_config_from_args(p.parse_args(["generate", "hi"])).async_decode is True
    assert engine_config_from_args(p.parse_args(["generate", "hi", "--no-async-decode"])).async_decode is False
