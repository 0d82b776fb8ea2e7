"""Streams that wait (in the engine's queue, for a long prefill) send SSE comment lines, so proxies
with idle timeouts keep the connection; clients (the ``openai`` one included) skip them."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.serve


def test_a_long_prefill_sends_keepalive_comments_before_the_first_token(app):
    interval = app.settings.sse_keepalive_s
    assert 0 < interval < 1  # the test app's: well below a 1800-token prefill on one CPU thread
    body = {"prompt": "The river bends past the mill and the old stone bridge. " * 150, "max_tokens": 2,
            "temperature": 0, "stream": True, "lserve": {"prefix_cache": False}}
    lines: list[tuple[float, str]] = []
    with httpx.stream("POST", f"{app.url}/v1/completions", json=body, headers=app.headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        start = time.monotonic()
        for line in r.iter_lines():
            if line:
                lines.append((time.monotonic() - start, line))
    first_token = next(i for i, (_, line) in enumerate(lines) if line.startswith("data: {"))
    comments = [(t, line) for t, line in lines[:first_token] if line.startswith(":")]
    assert comments, lines[:5]
    assert all(line == ": keep-alive" for _, line in lines if line.startswith(":")), lines
    assert lines[first_token][0] >= len(comments) * interval * 0.9  # one per silent interval, not a burst
    assert lines[-1][1] == "data: [DONE]"
    assert all(line.startswith(("data: ", ":")) for _, line in lines)


def test_the_openai_client_skips_keepalive_comments(app):
    client = openai.OpenAI(base_url=f"{app.url}/v1", api_key=app.api_key, max_retries=0, timeout=120)
    stream = client.completions.create(model=app.settings.model_name, max_tokens=3, temperature=0, stream=True,
                                       prompt="A lighthouse keeper writes in the log every night. " * 150,
                                       extra_body={"lserve": {"prefix_cache": False}, "ignore_eos": True})
    chunks = list(stream)
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1
    assert chunks[-1].choices[0].finish_reason == "length"
