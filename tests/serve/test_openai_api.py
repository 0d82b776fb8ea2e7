"""The official ``openai`` client against the real app: completions, chat, streaming, usage."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's own tokenizer (read from its GGUF), to check usage counts independently."""
    from transformers import AutoTokenizer

    from lserve.models.loader import default_model_path

    p = default_model_path()
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key=app.api_key, max_retries=0, timeout=120)


def test_models_lists_the_served_model(app):
    models = client(app).models.list()
    assert [m.id for m in models.data] == [app.settings.model_name]
    assert models.data[0].model_extra["max_model_len"] == 2048
    sparsity = models.data[0].model_extra["sparsity"]  # what is in effect, found by the model's identity
    assert sparsity["shipped"] == "smollm2-135m" and sparsity["token_budget"] == 0
    assert {"pattern", "streaming_fraction", "select_layers", "adaptive_budgets"} <= set(sparsity)


def test_completion_with_usage(app, tokenizer):
    prompt = "The capital of France is"
    out = client(app).completions.create(model=app.settings.model_name, prompt=prompt, max_tokens=6, temperature=0)
    assert out.object == "text_completion" and len(out.choices) == 1
    ch = out.choices[0]
    assert ch.finish_reason in ("length", "stop") and isinstance(ch.text, str) and ch.text
    n_prompt = len(tokenizer.encode(prompt))  # BOS included, as the engine encodes it
    assert out.usage.prompt_tokens == n_prompt
    if ch.finish_reason == "length":
        assert out.usage.completion_tokens == 6
    else:
        assert 1 <= out.usage.completion_tokens <= 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # greedy decoding is deterministic: the same request gives the same text
    again = client(app).completions.create(model=app.settings.model_name, prompt=prompt, max_tokens=6, temperature=0)
    assert again.choices[0].text == ch.text


def test_chat_completion_uses_the_chat_template(app, tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    out = client(app).chat.completions.create(model=app.settings.model_name, messages=messages, max_tokens=5,
                                              temperature=0)
    assert out.object == "chat.completion"
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content
    templ = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    templ = templ["input_ids"] if hasattr(templ, "keys") else templ
    assert out.usage.prompt_tokens == len(templ)
    assert out.usage.prompt_tokens > len(tokenizer.encode("You are terse. Say hello."))  # template tokens added
    if out.choices[0].finish_reason == "length":
        assert out.usage.completion_tokens == 5
    else:
        assert 1 <= out.usage.completion_tokens <= 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_chat_completion_matches_the_non_streamed_one(app):
    c = client(app)
    messages = [{"role": "user", "content": "Name three colours."}]
    full = c.chat.completions.create(model=app.settings.model_name, messages=messages, max_tokens=8, temperature=0)
    stream = c.chat.completions.create(model=app.settings.model_name, messages=messages, max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    usage_chunks = [ch for ch in chunks if ch.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    assert usage_chunks[0].usage.model_dump() == full.usage.model_dump()


def test_raw_sse_format_ends_with_done(app):
    body = {"model": app.settings.model_name, "prompt": "One, two, three,", "max_tokens": 4, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{app.url}/v1/completions", json=body, headers=app.headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers.get("x-lserve-replica")
        events = [line for line in r.iter_lines() if line and line != ": keep-alive"]  # SSE comments
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 1


def test_n_choices_and_seeded_sampling(app):
    c = client(app)
    kw = {"model": app.settings.model_name, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 1.0,
          "top_p": 0.9, "extra_body": {"top_k": 40}}
    a = c.completions.create(n=2, seed=123, **kw)
    b = c.completions.create(n=2, seed=123, **kw)
    assert sorted(ch.index for ch in a.choices) == [0, 1]
    assert [ch.text for ch in sorted(a.choices, key=lambda x: x.index)] == \
        [ch.text for ch in sorted(b.choices, key=lambda x: x.index)]  # same seeds, same samples
    assert a.usage.prompt_tokens == b.usage.prompt_tokens  # the prompt is counted once for n choices
    if all(ch.finish_reason == "length" for ch in a.choices):
        assert a.usage.completion_tokens == 10
    else:
        assert 2 <= a.usage.completion_tokens <= 10


def test_stop_strings_and_lserve_token_budget(app):
    c = client(app)
    out = c.completions.create(model=app.settings.model_name, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                               stop=[","], extra_body={"lserve": {"token_budget": 128, "streaming": True}})
    assert "," not in out.choices[0].text and out.choices[0].finish_reason == "stop"
