"""vLLM's ``POST /tokenize`` and ``/detokenize`` (lm-evaluation-harness and other tools use them),
and JSON bodies sent without a JSON content type, over HTTP against the real app."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlparse

import httpx
import pytest

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def hf_tokenizer():
    """The default model's own tokenizer, read from its GGUF: the reference the endpoints must match."""
    from transformers import AutoTokenizer

    from lserve.models.loader import default_model_path

    p = default_model_path()
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def post(app, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{app.url}{path}", json=body, headers=kw.pop("headers", app.headers), timeout=60, **kw)


def test_tokenize_and_detokenize_like_vllm(app, hf_tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    for special in (True, False):
        r = post(app, "/tokenize", {"prompt": text, "add_special_tokens": special})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["tokens"] == hf_tokenizer.encode(text, add_special_tokens=special)
        assert out["count"] == len(out["tokens"]) and out["max_model_len"] == app.settings.max_model_len
    messages = [{"role": "user", "content": "Name a colour."}]
    r = post(app, "/tokenize", {"model": app.settings.model_name, "messages": messages})
    assert r.status_code == 200, r.text
    want = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert r.json()["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)

    r = post(app, "/detokenize", {"tokens": hf_tokenizer.encode(text)})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": text}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, None),
])
def test_bad_tokenizer_requests_get_400(app, path, body, param):
    r = post(app, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and (param is None or err["param"] == param), err


def test_tokenizer_endpoints_need_the_api_key(app):
    assert post(app, "/tokenize", {"prompt": "a"}, headers={}).status_code == 401
    assert post(app, "/detokenize", {"tokens": [1]}, headers={}).status_code == 401


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_json_body_is_read_whatever_its_content_type(app, content_type):
    """``curl -d '{...}'`` sends application/x-www-form-urlencoded; the body is still the JSON request."""
    url = urlparse(app.url)
    body = json.dumps({"prompt": "One, two,", "max_tokens": 2, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {app.api_key}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n")
    if content_type:
        head += f"Content-Type: {content_type}\r\n"
    with socket.create_connection((url.hostname, url.port), timeout=60) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    status_line, _, rest = raw.partition(b"\r\n")
    assert status_line.split()[1] == b"200", raw[:500]
    payload = rest.split(b"\r\n\r\n", 1)[1]
    if b"transfer-encoding: chunked" in rest.lower().split(b"\r\n\r\n", 1)[0]:
        payload = b"".join(payload.split(b"\r\n")[1::2])  # de-chunk: size line, data, ...
    out = json.loads(payload)
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] == 2
