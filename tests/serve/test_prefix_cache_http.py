"""The prefix cache seen over HTTP: ``usage.prompt_tokens_details.cached_tokens`` and the
``lserve:prefix_cache_queries`` / ``lserve:prefix_cache_hits`` counters."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.serve

DOC = ("A shared document that several questions are asked about, so its KV pages are reused. " * 12)


def _counter(app, name: str, replica: str) -> float:
    text = httpx.get(f"{app.url}/metrics", timeout=30).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    fam = fams.get(name)
    return sum(s.value for s in fam.samples if s.name.endswith("_total") and s.labels.get("replica") == replica) \
        if fam else 0.0


def test_second_question_reports_cached_tokens(app):
    with app.client() as c:
        first = c.post("/v1/completions", json={"prompt": DOC + " Question 1: what is reused?", "max_tokens": 2})
        assert first.status_code == 200, first.text
        u1 = first.json()["usage"]
        assert u1["prompt_tokens_details"]["cached_tokens"] == 0
        rep = first.headers["x-lserve-replica"]
        hits_before = _counter(app, "lserve:prefix_cache_hits", rep)
        second = c.post("/v1/completions", json={"prompt": DOC + " Question 2: and what not?", "max_tokens": 2})
        assert second.status_code == 200 and second.headers["x-lserve-replica"] == rep  # affinity: same replica
        u2 = second.json()["usage"]
        page = app.settings.page_size
        assert u2["prompt_tokens_details"]["cached_tokens"] >= (u1["prompt_tokens"] // page - 1) * page > 0
        assert u2["prompt_tokens_details"]["cached_tokens"] % page == 0
        # the same through chat completions, and switched off per request
        msgs = [{"role": "system", "content": DOC}, {"role": "user", "content": "Summarise."}]
        for _ in range(2):
            chat = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        off = c.post("/v1/completions", json={"prompt": DOC + " Question 2: and what not?", "max_tokens": 2,
                                              "lserve": {"prefix_cache": False}})
        assert off.status_code == 200 and off.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    deadline = time.monotonic() + 10
    while _counter(app, "lserve:prefix_cache_hits", rep) - hits_before < u2["prompt_tokens_details"]["cached_tokens"]:
        assert time.monotonic() < deadline, "prefix_cache_hits did not count the second question's cached tokens"
        time.sleep(0.5)
    assert _counter(app, "lserve:prefix_cache_queries", rep) >= u1["prompt_tokens"] + u2["prompt_tokens"]
