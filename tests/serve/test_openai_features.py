"""Logprobs, echo (lm-evaluation-harness's log-likelihood request), penalties and model retrieval,
driven the way clients drive them: the official ``openai`` client and raw JSON against the app."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from logits_capture import capture_logits

from lserve.config import EngineConfig
from lserve.engine import LLMEngine, SamplingParams

pytestmark = pytest.mark.serve


def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key=app.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref_engine(smol):
    """A local engine over the same weights: the reference for values the server returns."""
    return LLMEngine(EngineConfig(model="default", max_model_len=2048), smol)


def next_logprobs(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """float32 [V]: log_softmax of the engine's own logits after ``ids`` (a plain forward)."""
    seen = capture_logits(engine)
    try:
        engine.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    finally:
        del engine.model.forward
    return torch.log_softmax(seen[-1][0], dim=-1)


def test_models_retrieve(app):
    c = client(app)
    m = c.models.retrieve(app.settings.model_name)
    assert m.id == app.settings.model_name and m.object == "model" and m.model_extra["max_model_len"] == 2048
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-17")
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"


def test_lm_eval_loglikelihood_request(app, ref_engine):
    """The body lm-evaluation-harness's ``local-completions`` sends for log-likelihood tasks
    (token-id prompts, batched), parsed as its ``parse_logprobs`` does."""
    tok = ref_engine.tokenizer
    contexts = ["The capital of France is", "Two plus two equals"]
    conts = [" Paris", " four"]
    prompts = [tok.encode(c + x) for c, x in zip(contexts, conts)]
    ctxlens = [len(tok.encode(c)) for c in contexts]
    body = {"model": app.settings.model_name, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    r = httpx.post(f"{app.url}/v1/completions", json=body, headers=app.headers, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    choices = sorted(out["choices"], key=lambda ch: ch["index"])
    assert len(choices) == 2
    for ch, ids, ctxlen in zip(choices, prompts, ctxlens):
        lp = ch["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first prompt token
        assert "".join(lp["tokens"][: len(ids)]) == tok.decode(ids)
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        for i in range(1, len(ids)):  # against log_softmax of the engine's logits after each prefix
            ref = next_logprobs(ref_engine, ids[:i])
            assert lp["token_logprobs"][i] == pytest.approx(ref[ids[i]].item(), abs=2e-3), i
            best = int(torch.argmax(ref))
            top = lp["top_logprobs"][i]
            assert max(top.values()) == pytest.approx(ref[best].item(), abs=2e-3)
        # lm-eval's parse_logprobs: the continuation's log-likelihood and whether it is greedy
        score = sum(lp["token_logprobs"][ctxlen:-1])
        ref_score = sum(next_logprobs(ref_engine, ids[:i])[ids[i]].item() for i in range(ctxlen, len(ids)))
        assert score == pytest.approx(ref_score, abs=5e-3)
        greedy = all(t == max(d.values()) for t, d in zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]))
        assert greedy == all(int(torch.argmax(next_logprobs(ref_engine, ids[:i]))) == ids[i]
                             for i in range(ctxlen, len(ids)))
    # max_tokens 0: the prompt alone, scored
    body.update(max_tokens=0, prompt=prompts[0])
    zero = httpx.post(f"{app.url}/v1/completions", json=body, headers=app.headers, timeout=120).json()
    ch = zero["choices"][0]
    assert zero["usage"]["completion_tokens"] == 0 and ch["finish_reason"] == "length"
    assert ch["text"] == tok.decode(prompts[0])
    assert ch["logprobs"]["token_logprobs"] == pytest.approx(choices[0]["logprobs"]["token_logprobs"][:-1], abs=1e-4)


def test_echo_with_a_text_prompt_and_streaming(app):
    c = client(app)
    kw = {"model": app.settings.model_name, "prompt": "One, two, three,", "max_tokens": 4, "temperature": 0,
          "logprobs": 2, "echo": True}
    full = c.completions.create(**kw)
    ch = full.choices[0]
    assert ch.text.startswith("One, two, three,") and len(ch.text) > len("One, two, three,")
    n_prompt = full.usage.prompt_tokens
    assert len(ch.logprobs.tokens) == n_prompt + full.usage.completion_tokens
    assert all(len(d) >= 2 for d in ch.logprobs.top_logprobs[1:])
    chunks = list(c.completions.create(stream=True, **kw))
    assert "".join(x.choices[0].text for x in chunks) == ch.text
    streamed = [x.choices[0].logprobs for x in chunks if x.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == ch.logprobs.tokens
    assert sum((s.text_offset for s in streamed), []) == ch.logprobs.text_offset
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(ch.logprobs.token_logprobs, abs=1e-6)


def test_chat_logprobs_and_top_logprobs(app):
    c = client(app)
    kw = {"model": app.settings.model_name, "messages": [{"role": "user", "content": "Name a colour."}],
          "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    out = c.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy
        assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    text = "".join(e.token for e in content)
    assert text.startswith(out.choices[0].message.content)  # the EOS token, if any, is listed but not in the text
    streamed = [e for x in c.chat.completions.create(stream=True, **kw)
                if x.choices and x.choices[0].logprobs for e in x.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    plain = c.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_penalties_bias_min_tokens_through_the_client(app, ref_engine):
    c = client(app)
    prompt = "The list: apple, apple, apple, banana, apple, apple,"
    base = {"model": app.settings.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    plain = c.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    fancy = {"presence_penalty": 0.8, "frequency_penalty": 1.2, "logit_bias": {"11": -100}}
    extra = {"repetition_penalty": 1.5, "ignore_eos": True}
    got = c.completions.create(**base, **fancy, extra_body=extra).choices[0].text
    ref = ref_engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, presence_penalty=0.8,
                                                       frequency_penalty=1.2, logit_bias={11: -100.0},
                                                       repetition_penalty=1.5, ignore_eos=True))[0].text
    assert got == ref and got != plain
    apple = ref_engine.tokenizer.encode(" apple")[0]
    forced = c.completions.create(**base, logit_bias={str(apple): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == " apple" * 6
    eos = ref_engine.eos_ids[0]
    early = c.completions.create(**base, logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    assert early.usage.completion_tokens == 4 and early.choices[0].finish_reason == "stop"


def test_neutral_values_of_unsupported_fields_are_accepted(app):
    body = {"model": app.settings.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
    r = httpx.post(f"{app.url}/v1/chat/completions", content=json.dumps(body),
                   headers={**app.headers, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
