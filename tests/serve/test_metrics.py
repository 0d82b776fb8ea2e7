"""``/metrics`` after traffic: vLLM-style ``lserve:`` series from every engine replica."""

from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.serve

HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds"]


def scrape(app) -> tuple[str, dict]:
    r = httpx.get(f"{app.url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text, {f.name: f for f in text_string_to_metric_families(r.text)}


def total(family, suffix: str = "", **labels) -> float:
    return sum(s.value for s in family.samples
               if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_after_traffic(app):
    _, before = scrape(app)
    gen_before = total(before["lserve:generation_tokens"], "_total") if "lserve:generation_tokens" in before else 0
    with app.client() as c:
        for i in range(3):
            r = c.post("/v1/completions", json={"prompt": f"Metrics request {i} says", "max_tokens": 4,
                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
        body = {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 4, "stream": True,
                "ignore_eos": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200
            s.read()
        assert c.post("/v1/completions", json={"prompt": "x", "temperature": 9}).status_code == 400
        # a per-request token budget below the context turns page selection on for this request;
        # the selector keeps budget/page_size pages per dense head, so twice the budget, twice the pages.
        # Measured from the counters over whole requests: the per-run gauge covers one export period,
        # which can end mid-step, and layers differ in their number of dense heads.
        per_run, kv_frac = {}, {}
        for budget in (128, 256):
            fams0 = scrape(app)[1]
            r = c.post("/v1/completions", json={"prompt": "The quick brown fox jumps over the lazy dog. " * 40,
                                                "max_tokens": 6, "ignore_eos": True, "lserve": {"token_budget": budget}})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 300
            time.sleep(1.5)
            fams1 = scrape(app)[1]
            rep = r.headers["x-lserve-replica"]
            delta = {n: total(fams1[n], "_total", replica=rep)
                     - (total(fams0[n], "_total", replica=rep) if n in fams0 else 0)
                     for n in ("lserve:sparsity_selected_pages", "lserve:sparsity_selector_runs",
                               "lserve:decode_kv_read_head_tokens", "lserve:decode_kv_dense_head_tokens")}
            assert delta["lserve:sparsity_selector_runs"] > 0, budget
            kv_frac[budget] = delta["lserve:decode_kv_read_head_tokens"] / delta["lserve:decode_kv_dense_head_tokens"]
            per_run[budget] = delta["lserve:sparsity_selected_pages"] / delta["lserve:sparsity_selector_runs"]
            assert total(fams1["lserve:sparsity_selected_pages_per_run"], replica=rep) > 0
    time.sleep(1.5)  # replicas export engine gauges/counters twice a second
    text, fams = scrape(app)
    assert all(name.startswith("lserve:") for name in fams)
    assert not [name for name in fams if name.startswith("lserve:host_kv_")]  # the host KV tier is off here

    engines = app.engines()
    replicas = {r["replica"] for r in engines}  # the failover test (which replaces one) runs later
    assert all("prefix_evicted" not in r and r["aborted"] >= 0 for r in engines)  # no hash lists in the admin view
    # where a replica's step time went, by kind, and what its step budget learnt (the serve default is timed)
    worked = [r for r in engines if r["steps"]]
    assert worked and all(sum(s for s, _ in r["step_seconds"].values()) > 0 for r in worked)
    assert all(set(r["step_seconds"]) == set(r["step_kinds"]) for r in worked)
    assert all(r["budget"]["rate"] > 0 and r["budget"]["sparse_share"] == 1.0 for r in worked)
    for h in HISTOGRAMS:
        fam = fams[f"lserve:{h}"]
        assert fam.type == "histogram"
        assert total(fam, "_count") >= (8 if h == "inter_token_latency_seconds" else 4), h
        assert total(fam, "_sum") > 0 or h == "request_queue_time_seconds"
        for s in fam.samples:
            assert s.labels["model"] == "default" and s.labels["replica"] in replicas
    # counters
    assert total(fams["lserve:generation_tokens"], "_total") - gen_before >= 16
    assert total(fams["lserve:prompt_tokens"], "_total") > 0
    assert total(fams["lserve:request_success"], "_total", finished_reason="length") >= 4
    for name in ("lserve:num_preemptions", "lserve:num_aborted_requests", "lserve:engine_steps",
                 "lserve:sparsity_selection_reuses", "lserve:sparsity_selector_seconds"):
        assert fams[name].type == "counter"
    runs_before = total(before["lserve:sparsity_selector_runs"], "_total") if "lserve:sparsity_selector_runs" in before else 0
    assert total(fams["lserve:sparsity_selector_runs"], "_total") > runs_before  # the budgeted request selected pages
    assert total(fams["lserve:sparsity_selected_pages"], "_total") > 0
    assert per_run[128] > 0 and per_run[256] == pytest.approx(2 * per_run[128]), per_run
    # decode KV bytes read vs dense: the smaller budget reads less; the gauge is a fraction
    assert 0 < kv_frac[128] < kv_frac[256] < 1, kv_frac
    read, dense = (total(fams[f"lserve:decode_kv_{n}_head_tokens"], "_total") for n in ("read", "dense"))
    assert 0 < read < dense
    assert fams["lserve:decode_kv_read_fraction"].type == "gauge"
    assert all(0 < s.value <= 1 for s in fams["lserve:decode_kv_read_fraction"].samples)
    ok = total(fams["lserve:http_responses"], "_total", endpoint="/v1/completions", status="200")
    bad = total(fams["lserve:http_responses"], "_total", endpoint="/v1/completions", status="400")
    assert ok >= 3 and bad >= 1
    # gauges: one series per live replica (and per pool for KV usage)
    for name in ("lserve:num_requests_running", "lserve:num_requests_waiting", "lserve:kv_cache_dense_pages_used",
                 "lserve:sparsity_token_budget", "lserve:sparsity_streaming_heads_fraction"):
        assert {s.labels["replica"] for s in fams[name].samples} == replicas, name
    pools = {(s.labels["replica"], s.labels["pool"]) for s in fams["lserve:kv_cache_usage_perc"].samples}
    assert pools == {(r, p) for r in replicas for p in ("dense", "streaming")}
    assert total(fams["lserve:num_requests_running"]) == 0  # the traffic has finished

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'); exposition format checked by the parser only")
    p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    problems = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    # vLLM-style names use a colon, which promtool's linter flags (exit code 3) as a naming convention;
    # anything else (exit code 1: unparsable, or another lint rule) fails the test.
    assert p.returncode in (0, 3), p.stdout + p.stderr
    assert all("should not contain ':'" in line for line in problems), problems

