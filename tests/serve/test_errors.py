"""Every bad input gets its HTTP status and an OpenAI-shaped JSON error, never a stack trace."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.serve


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "?", code: str | None = "?",
                        contains: str = "") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param != "?":
        assert err["param"] == param, err
    if code != "?":
        assert err["code"] == code, err
    assert contains in err["message"], err
    return err


def post(app, path: str, body, headers: dict | None = None, **kw) -> httpx.Response:
    h = dict(app.headers) if headers is None else headers
    # JSON with non-ASCII escaped (\\uXXXX), as many clients send it: a lone surrogate can travel too
    return httpx.post(f"{app.url}{path}", content=json.dumps(body, separators=(",", ":")),
                      headers={"content-type": "application/json", **h}, timeout=60, **kw)


def comp(**kw) -> dict:
    return {"model": "default", "prompt": "Hello", "max_tokens": 2, **kw}


def chat(**kw) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, **kw}


@pytest.mark.parametrize("body, param, contains", [
    (comp(temperature=-0.5), "temperature", "greater than or equal to 0"),
    (comp(temperature=2.5), "temperature", "less than or equal to 2"),
    (comp(temperature="hot"), "temperature", "valid number"),
    (comp(top_p=0), "top_p", "top_p must be in (0, 1]"),
    (comp(top_p=1.5), "top_p", "top_p must be in (0, 1]"),
    (comp(top_k=-2), "top_k", "top_k must be -1, 0 or a positive integer"),
    (comp(max_tokens=-1), "max_tokens", "max_tokens must be an integer >= 1"),
    (comp(max_tokens="10"), "max_tokens", "valid integer"),
    (comp(n=0), "n", "greater than or equal to 1"),
    (comp(n=9), "n", "less than or equal to 8"),
    (comp(seed=-1), "seed", "seed must be an integer in [0, 9223372036854775807]"),
    (comp(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4 stop strings"),
    (comp(stop=[""]), "stop", "stop strings must be non-empty"),
    (comp(stop=["x" * 257]), "stop", "at most 256 characters"),
    (comp(stream="yes"), "stream", "valid boolean"),
    (comp(presence_penalty=2.5), "presence_penalty", "presence_penalty must be in [-2, 2]"),
    (comp(frequency_penalty=-3), "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
    (comp(repetition_penalty=0), "repetition_penalty", "repetition_penalty must be in (0, 100]"),
    (comp(logprobs=6), "logprobs", "less than or equal to 5"),
    (comp(logprobs=-1, echo=True), "logprobs", "logprobs must be in [0, 20]"),
    (comp(lserve={"prefill_sparsity": 1.5}), "lserve.prefill_sparsity", "prefill_sparsity must be in [0, 1]"),
    (comp(max_tokens=0), "max_tokens", "0 only when the prompt is scored: prompt logprobs, echo: true"),
    (comp(logit_bias={"abc": 1}), "logit_bias", "token ids"),
    (comp(logit_bias={"5": 101}), "logit_bias", "logit_bias values must be in [-100, 100]"),
    (comp(logit_bias={"99999999": 1}), "logit_bias", "outside the vocabulary"),
    (comp(min_tokens=3), "min_tokens", "must not exceed max_tokens (2)"),
    (comp(response_format={"type": "json_object"}), "response_format", "not supported"),
    (comp(stream_options={"include_usage": True}), "stream_options", "only allowed with stream: true"),
    (comp(prompt="ab\ud800cd"), "prompt", "unpaired UTF-16 surrogate (U+D800 at character 2)"),
    (comp(stop=["\udfff"]), "stop", "unpaired UTF-16 surrogate"),
    (comp(best_of=3), "best_of", "not supported"),
    (comp(prompt=""), "prompt", "empty"),
    (comp(prompt=[]), "prompt", "empty"),
    (comp(prompt=[[1, 2], []]), "prompt", "empty"),
    (comp(prompt=["a", "b", "c"], n=3), "n", "at most 8"),
    (comp(prompt=None), "prompt", ""),
    ({"model": "default", "max_tokens": 2}, "prompt", "Field required"),
    (comp(lserve={"streaming": False}), "lserve.streaming", "not supported on this deployment"),
    (comp(lserve={"token_budget": 10}), "lserve.token_budget", "at least two KV pages (128 tokens), got 10"),
    (comp(lserve={"token_budget": 4096}), "lserve.token_budget", "exceeds the model's context length (2048)"),
    (comp(lserve={"token_budget": -1}), "lserve.token_budget", "token_budget must be an integer >= 0"),
    (comp(lserve={"sparsity": 0.3}), "lserve.sparsity", "Extra inputs are not permitted"),
    (comp(stream_options={"include_usage": "yes"}), "stream_options.include_usage", "valid boolean"),
])
def test_invalid_completion_parameters_are_400(app, body, param, contains):
    assert_openai_error(post(app, "/v1/completions", body), 400, param=param, contains=contains)


@pytest.mark.parametrize("body, param, contains", [
    (chat(messages=[]), "messages", "at least 1 item"),
    (chat(messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role", "Input should be"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages.0.content", ""),
    (chat(messages="hello"), "messages", "valid list"),
    (chat(max_completion_tokens=0), "max_completion_tokens", "max_tokens must be an integer >= 1 (0 only when"),
    (chat(max_tokens=-3), "max_tokens", "max_tokens must be an integer >= 1"),
    (chat(logprobs=True, top_logprobs=-1), "top_logprobs", "logprobs must be in [0, 20]"),
    (chat(min_tokens=5), "min_tokens", "min_tokens (5) must not exceed max_tokens (2)"),
    (chat(top_logprobs=3), "top_logprobs", "needs logprobs: true"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs", "logprobs must be in [0, 20], got 21"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "not supported"),
    (chat(tool_choice="auto"), "tool_choice", "not supported"),
    (chat(response_format={"type": "json_schema", "json_schema": {}}), "response_format", "not supported"),
    (chat(messages=[{"role": "user"}]), "messages.0.content", "Field required"),
    (chat(messages=[{"role": "assistant", "content": None}]), "messages.0.content", ""),
    (chat(messages=[{"role": "user", "content": "hi \ud800"}]), "messages.0.content", "unpaired UTF-16 surrogate"),
    (chat(stream_options={"include_usage": True}, stream=False), "stream_options", "only allowed with stream"),
])
def test_invalid_chat_parameters_are_400(app, body, param, contains):
    assert_openai_error(post(app, "/v1/chat/completions", body), 400, param=param, contains=contains)


def test_malformed_bodies_are_400(app):
    h = {**app.headers, "content-type": "application/json"}
    for raw in (b"{not json", b"[1, 2, 3]", b'"just a string"', b""):
        r = httpx.post(f"{app.url}/v1/completions", content=raw, headers=h, timeout=30)
        assert_openai_error(r, 400)


def test_context_length_is_400_with_the_numbers(app):
    r = post(app, "/v1/completions", comp(max_tokens=2040, prompt="one two three four five six seven eight nine"))
    err = assert_openai_error(r, 400, param="prompt", code="context_length_exceeded",
                              contains="maximum context length is 2048 tokens")
    assert "2040 to generate" in err["message"] and "in the prompt" in err["message"]
    long_prompt = "word " * 2100  # > 2048 tokens by itself
    r = post(app, "/v1/chat/completions", chat(messages=[{"role": "user", "content": long_prompt}], max_tokens=None))
    assert_openai_error(r, 400, param="messages", code="context_length_exceeded", contains="2048")


def test_unknown_model_is_404(app):
    err = assert_openai_error(post(app, "/v1/completions", comp(model="gpt-17")), 404, param="model",
                              code="model_not_found", contains="gpt-17")
    assert "default" in err["message"]
    assert_openai_error(post(app, "/v1/chat/completions", chat(model="nope")), 404, param="model")


def test_unknown_route_and_method_are_json(app):
    assert_openai_error(httpx.get(f"{app.url}/v2/whatever", headers=app.headers), 404)
    assert_openai_error(httpx.get(f"{app.url}/v1/completions", headers=app.headers), 405)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key-lserve"},
                                     {"Authorization": "Basic dGVzdA=="}])
def test_missing_or_wrong_api_key_is_401(app, headers):
    for method, path, body in (("POST", "/v1/completions", comp()), ("POST", "/v1/chat/completions", chat()),
                               ("GET", "/v1/models", None), ("GET", "/admin/engines", None)):
        r = httpx.request(method, f"{app.url}{path}", json=body, headers=headers, timeout=30)
        assert_openai_error(r, 401, code="invalid_api_key")
        assert r.headers.get("www-authenticate") == "Bearer"
    # probes and scrapers do not need the key
    assert httpx.get(f"{app.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{app.url}/metrics", timeout=30).status_code == 200


@pytest.mark.parametrize("content", [b"{not json", b'{"prompt": 5, "max_tokens": "many"}', b"",
                                     b"x" * (300 * 1024)])
def test_authentication_comes_before_the_body(app, content):
    """Without the key every body, broken, invalid or too large, gets 401 (with it: 400 or 413)."""
    h = {"content-type": "application/json"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(f"{app.url}{path}", content=content, headers=h, timeout=30)
        assert_openai_error(r, 401, code="invalid_api_key")
        r = httpx.post(f"{app.url}{path}", content=content, headers={**h, **app.headers}, timeout=30)
        assert r.status_code == (413 if len(content) > app.settings.max_body_bytes else 400), r.text


def test_oversized_bodies_are_413(app):
    limit = app.settings.max_body_bytes
    big = comp(prompt="x" * (limit + 10))
    assert_openai_error(post(app, "/v1/completions", big), 413, code="request_too_large", contains=str(limit))

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(limit // 1024 + 2):
            yield b" " * 1024

    r = httpx.post(f"{app.url}/v1/completions", content=chunks(),
                   headers={**app.headers, "content-type": "application/json"}, timeout=60)
    assert_openai_error(r, 413, contains=str(limit))


def test_errors_do_not_leave_requests_behind(app):
    post(app, "/v1/completions", comp(max_tokens=5000))
    post(app, "/v1/completions", comp(lserve={"streaming": False}))
    app.wait_idle(timeout=10)
