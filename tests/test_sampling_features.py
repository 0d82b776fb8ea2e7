"""Logprobs, prompt logprobs, penalties, logit_bias, min_tokens and ignore_eos in the engine,
checked against the engine's own logits and a plain reference implementation of each rule."""

from __future__ import annotations

import pytest
import torch

from lserve.config import CacheConfig, EngineConfig
from lserve.engine import LLMEngine, RequestError, SamplingParams
from lserve.engine.sampling import sample

PAGES = CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=4096)
PROMPT = "The list: apple, apple, apple, banana, apple, apple,"


@pytest.fixture(scope="module")
def eng(smol):
    return LLMEngine(EngineConfig(model="default", cache=PAGES), smol)


def _capture(engine: LLMEngine) -> list[torch.Tensor]:
    """Raw logits of every forward (before the engine's processing), in call order."""
    seen = []
    fwd = engine.model.forward

    def wrapped(*a, **k):
        out = fwd(*a, **k)
        seen.append((out[0] if isinstance(out, tuple) else out).clone())
        return out

    engine.model.forward = wrapped
    return seen


def _release(engine: LLMEngine) -> None:
    del engine.model.forward  # back to the class method


def _next_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """float32 [V]: the engine's logits after ``ids`` (a plain one-token greedy request)."""
    seen = _capture(engine)
    try:
        engine.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    finally:
        _release(engine)
    return seen[-1][0]


def test_greedy_logprobs_are_log_softmax_of_the_logits(eng):
    seen = _capture(eng)
    try:
        out = eng.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5))[0]
    finally:
        _release(eng)
    assert len(out.logprobs) == len(out.token_ids) == 4 and len(seen) == 4
    for (tok, lp, top), logits in zip(out.logprobs, seen):
        ref = torch.log_softmax(logits[0], dim=-1)
        assert tok == int(torch.argmax(ref))
        assert lp == pytest.approx(ref[tok].item(), abs=1e-5)
        vals, ids = ref.topk(5)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-5)
        assert top[0] == (tok, lp)  # greedy: the chosen token is the best one


def test_prompt_logprobs_match_the_forward_of_every_prefix(smol, eng):
    ids = eng.tokenizer.encode(PROMPT)
    # Small steps: the prompt is prefilled in chunks, next to another request's prefill.
    chunked = LLMEngine(EngineConfig(model="default", cache=PAGES, max_batched_tokens=16), smol)
    other = "Water boils at"
    rid = chunked.add_request(ids, SamplingParams(max_tokens=0, prompt_logprobs=2))
    oid = chunked.add_request(other, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    final = {}
    while chunked.has_unfinished():
        final.update((o.request_id, o) for o in chunked.step() if o.finished)
    out = final[rid]
    assert out.token_ids == [] and out.finish_reason == "length"
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        ref = torch.log_softmax(_next_logits(eng, ids[:i]), dim=-1)
        tok, lp, top = out.prompt_logprobs[i]
        assert tok == ids[i]
        assert lp == pytest.approx(ref[ids[i]].item(), abs=2e-4)
        assert [t for t, _ in top] == ref.topk(2).indices.tolist()
    # the request next to it is as it is alone
    assert final[oid].token_ids == eng.generate([other], SamplingParams(max_tokens=5, temperature=0,
                                                                        ignore_eos=True))[0].token_ids
    assert chunked.cache.all_free()


def _reference_penalize(logits: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    """The rules written out token by token (vLLM/OpenAI definitions)."""
    x = logits.clone()
    for tok, b in (p.logit_bias or {}).items():
        x[tok] += b
    for tok in set(prompt) | set(out):
        if p.repetition_penalty != 1.0:
            x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok in set(out):
        x[tok] -= p.frequency_penalty * out.count(tok) + p.presence_penalty
    return x


@pytest.mark.parametrize("kw", [{"repetition_penalty": 1.8}, {"frequency_penalty": 1.5, "presence_penalty": 0.8},
                                {"presence_penalty": -2.0, "logit_bias": {"11977": 5.0}}],
                         ids=["repetition", "frequency+presence", "bias+negative-presence"])
def test_penalties_follow_their_definition(eng, kw):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, **kw)
    plain = eng.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    seen = _capture(eng)
    try:
        out = eng.generate([PROMPT], params)[0]
    finally:
        _release(eng)
    assert out.token_ids != plain  # the penalty bites on this prompt
    prompt = out.prompt_token_ids
    for i, logits in enumerate(seen):  # the raw logits of each step, before the engine's processing
        ref = _reference_penalize(logits[0], prompt, out.token_ids[:i], params)
        assert out.token_ids[i] == int(torch.argmax(ref)), i


def test_min_tokens_logit_bias_and_ignore_eos(eng):
    eos = eng.eos_ids[0]
    force_eos = {eos: 100.0}
    out = eng.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, logit_bias=force_eos))[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = eng.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, logit_bias=force_eos, min_tokens=3))[0]
    assert len(out.token_ids) == 4 and eos not in out.token_ids[:3] and out.token_ids[3] == eos
    out = eng.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0, logit_bias=force_eos, ignore_eos=True))[0]
    assert out.token_ids == [eos] * 5 and out.finish_reason == "length"
    # stop_token_ids are held back by min_tokens too, and sampled rows follow the same rules
    stop = eng.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0))[0].token_ids[0]
    out = eng.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.8, seed=1, stop_token_ids=[stop],
                                                logit_bias={stop: 100.0}, min_tokens=2))[0]
    assert stop not in out.token_ids[:2] and out.token_ids[2] == stop and out.finish_reason == "stop"


@pytest.mark.parametrize("async_decode", [True, False], ids=["async", "sync"])
def test_one_requests_penalties_never_touch_another_row(smol, async_decode):
    eng = LLMEngine(EngineConfig(model="default", cache=PAGES, async_decode=async_decode), smol)
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True)
    fancy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, repetition_penalty=2.0,
                           frequency_penalty=1.0, logit_bias={"11": -100.0}, logprobs=3)
    prompts = [PROMPT, PROMPT, "Water boils at"]
    alone = [eng.generate([p], sp)[0] for p, sp in zip(prompts, [plain, fancy, sampled])]
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, [plain, fancy, sampled])]
    final, sizes = {}, []
    while eng.has_unfinished():
        outs = eng.step()
        sizes.append(len(outs))
        final.update((o.request_id, o) for o in outs if o.finished)
    assert sizes[0] == 3  # all three rows in every step
    for rid, ref in zip(rids, alone):
        assert final[rid].token_ids == ref.token_ids
    for (tok, lp, top), (rtok, rlp, rtop) in zip(final[rids[1]].logprobs, alone[1].logprobs, strict=True):
        assert tok == rtok and lp == pytest.approx(rlp, abs=1e-4) and [t for t, _ in top] == [t for t, _ in rtop]
    assert final[rids[0]].logprobs is None


def test_plain_greedy_decode_still_chains(smol):
    eng = LLMEngine(EngineConfig(model="default", cache=PAGES, async_decode=True), smol)
    chained = []
    for params in (SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, presence_penalty=1.0)):
        eng.add_request(PROMPT, params)
        steps = 0
        while eng.has_unfinished():
            eng.step()
            steps += bool(eng.last_step_info.get("chained"))
        chained.append(steps)
    assert chained[0] > 0 and chained[1] == 0


def test_bad_sampling_values_are_rejected(eng):
    for kw, param in (({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
                      ({"presence_penalty": 2.5}, "presence_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
                      ({"logit_bias": {"x": 1.0}}, "logit_bias"), ({"logit_bias": {5: 101.0}}, "logit_bias"),
                      ({"logit_bias": {"²": 1.0}}, "logit_bias"), ({"logprobs": 21}, "logprobs"),
                      ({"temperature": float("nan")}, "temperature"), ({"seed": 2**64}, "seed")):
        with pytest.raises(RequestError) as e:
            SamplingParams(**kw)
        assert e.value.param == param, (kw, e.value)
    assert SamplingParams(logit_bias={"7": 1.5, 9: -2.0}).logit_bias == {7: 1.5, 9: -2.0}  # JSON keys are strings
    with pytest.raises(RequestError) as e:
        eng.add_request(PROMPT, SamplingParams(logit_bias={10**7: 1.0}))
    assert e.value.param == "logit_bias" and "outside the vocabulary" in str(e.value)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_tiny_temperature_samples_greedily(temperature):
    # logits / 1e-300 overflows to inf and softmax gives NaN: the fuzz test once killed the engine loop so
    logits = torch.randn(512, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=temperature, max_tokens=1)
    assert params.greedy
    assert sample(logits, params, torch.Generator().manual_seed(1)) == int(torch.argmax(logits))


def test_overflowing_repetition_penalty_samples_among_the_infinite_logits(eng):
    """repetition_penalty 5e-324 is in (0, 100] but divides a seen token's positive logit to inf
    (the fuzz test killed the engine loop with it, 2026-12-04): sampling draws among those tokens,
    and the request gets its tokens."""
    logits = torch.tensor([1.0, 2.0, float("inf"), -3.0, float("inf")])
    params = SamplingParams(temperature=1.0, max_tokens=1)
    picks = {sample(logits, params, torch.Generator().manual_seed(i)) for i in range(40)}
    assert picks == {2, 4}
    outs = eng.generate([PROMPT], SamplingParams(max_tokens=4, temperature=1.0, repetition_penalty=5e-324, seed=3))
    assert outs[0].finished and len(outs[0].token_ids) == 4
