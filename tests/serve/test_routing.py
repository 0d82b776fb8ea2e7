"""The router's decisions with two real CPU replicas: prefix affinity, load fallback, spreading."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack

import pytest

pytestmark = pytest.mark.serve

DOC = ("LServe routes requests that share a long prefix to the replica that served it before. " * 14)[:1100]


def token_load(rep: dict, page_size: int) -> int:
    return rep["queued_prompt_tokens"] + rep["dense_pages_used"] * page_size


def test_shared_long_prefix_sticks_to_one_replica(app):
    with app.client() as c:
        seen = []
        for i in range(8):
            r = c.post("/v1/completions", json={"prompt": DOC + f" Question {i}: what is routed?", "max_tokens": 1})
            assert r.status_code == 200, r.text
            seen.append(r.headers["x-lserve-replica"])
    assert len(set(seen)) == 1, seen


def test_distinct_prefixes_spread_over_both_replicas(app):
    with app.client() as c:
        seen = set()
        for i in range(14):
            prompt = (f"Document {i} about topic {i * 7919 % 104729}. " * 12)[:300] + " Summary:"
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-lserve-replica"])
    assert len(seen) == 2, seen


def test_overloaded_prefix_holder_gives_way_to_the_least_loaded_replica(app):
    s = app.settings
    page = s.page_size
    # Cache off for these: with it, readers of one document share its pages and the holder's KV
    # load grows by a page per reader, too slowly to ever exceed the allowance here. A document no
    # other test sent: pages of one cached earlier and evicted now would be dropped from the
    # router's table (it follows evictions), and the prefix would stop counting.
    doc = DOC.replace("LServe routes", "The router sends")
    body = {"max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True, "lserve": {"prefix_cache": False}}
    placed: list[tuple[str, dict]] = []  # (replica, loads seen just before sending)
    held = []
    with ExitStack() as stack, app.client() as c:
        for i in range(10):
            loads = {r["replica"]: token_load(r, page) for r in app.engines()}
            r = stack.enter_context(c.stream("POST", "/v1/completions",
                                             json={**body, "prompt": doc + f" Reader {i} asks:"}))
            assert r.status_code == 200
            lines = r.iter_lines()
            held.append(lines)  # hold the stream open once it is generating (unreferenced, it would close)
            for line in lines:
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    break
            placed.append((r.headers["x-lserve-replica"], loads))
            time.sleep(2.5 * s.routing_stats_period_s)  # let the replicas report their new load
            if len({rep for rep, _ in placed}) == 2:
                break
    holder = placed[0][0]
    moved = [i for i, (rep, _) in enumerate(placed) if rep != holder]
    assert moved, f"the prefix holder was never considered overloaded: {placed}"
    k = moved[0]
    assert k >= 2, f"affinity should keep at least the first two on one replica: {placed}"
    assert all(rep == holder for rep, _ in placed[:k])
    # it moved because the holder's token load had grown past the allowed imbalance ...
    seen = placed[k][1]
    other = next(r for r in seen if r != holder)
    assert seen[holder] > s.imbalance_ratio * seen[other] + s.imbalance_tokens * 0.5, placed
    # ... and not before: while the holder was well within the allowance it kept the prefix (the
    # allowance also covers the request's tokens the router takes as cached there: its ~220-token
    # document, at most 4 pages)
    for rep, loads in placed[:k]:
        assert rep == holder and loads[holder] <= s.imbalance_ratio * min(loads.values()) + s.imbalance_tokens + 4 * page
    app.wait_idle(timeout=30)  # closing the held streams aborted them and freed their pages
