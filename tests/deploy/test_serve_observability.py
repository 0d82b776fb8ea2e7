"""End to end on the CPU: the real server, a short load test, a real Prometheus, every query.

One ``lserve serve`` (default model, 127.0.0.1) and one Prometheus scraping it every second are
started for this module (conftest.py). Two short load runs go through ``python -m load_tests``:
long prompts sharing prefixes (Poisson arrivals) and passkey prompts (fixed concurrency). Then:

* the reports agree with what the server counted (requests, prompt and generated tokens);
* every PromQL expression of the Grafana dashboards and the alert rules parses in Prometheus, and
  every panel query returns data for the load window;
* Prometheus evaluates the alert rules without errors;
* the per-pod metrics sidecar serves the same series as the ingress's /metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
from deploy_helpers import DEPLOY, REPO, alert_rules, dashboard_queries, finite_points, substitute
from ports import free_port

pytestmark = [pytest.mark.deploy_server, pytest.mark.slow]

SLOS = ["--slo", "ttft:60000", "--slo", "tpot:5000"]  # loose: a shared 2-core CPU is slow


def run_load_test(server, out, *args) -> dict:
    cmd = [sys.executable, "-m", "load_tests", "--base-url", server.url, "--no-progress", "--out", str(out), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def load_run(lserve_server, prometheus, tmp_path_factory):
    """Two short load runs while Prometheus scrapes; returns the reports and the time window."""
    out = tmp_path_factory.mktemp("load")
    start = time.time()
    shared = run_load_test(lserve_server, out / "shared.json", "--dataset", "shared-prefix", "--num-prompts", "6",
                           "--prefix-len", "256", "--num-prefixes", "2", "--input-len", "40", "--output-len", "8",
                           "--request-rate", "2", "--time-limit", "300", *SLOS)
    passkey = run_load_test(lserve_server, out / "passkey.json", "--dataset", "passkey", "--num-prompts", "2",
                            "--context-len", "400", "--output-len", "8", "--concurrency", "2", "--time-limit", "300",
                            *SLOS)
    # Let the engines' 0.5 s metric poll and two more scrapes land.
    time.sleep(4)
    return {"shared": shared, "passkey": passkey, "start": start, "end": time.time(), "dir": out}


def test_reports_are_complete(load_run):
    shared, passkey = load_run["shared"], load_run["passkey"]
    for rep, n in ((shared, 6), (passkey, 2)):
        res = rep["results"]
        assert (res["sent"], res["successful"], res["failed"], res["not_sent"]) == (n, n, 0, 0), res["errors"]
        for key in ("ttft_ms", "e2e_ms"):
            d = res[key]
            assert d["count"] == n and 0 < d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
        assert res["request_throughput"] > 0 and res["output_token_throughput"] > 0
        assert rep["command"].startswith("python -m load_tests ")
        assert (load_run["dir"] / (("shared" if rep is shared else "passkey") + ".png")).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # ignore_eos: every shared-prefix request generated exactly --output-len tokens
    assert shared["results"]["output_tokens"] == 6 * 8
    assert all(r["input_len"] == 256 + 40 for r in shared["requests"])
    # one ITL per text event after the first (vLLM's bench): tokens a slow reader missed come as one event
    events = [len(r["itl"]) + 1 for r in shared["requests"]]
    assert shared["results"]["itl_ms"]["count"] == sum(events) - 6 and all(1 <= e <= 8 for e in events)
    assert sum(events) > 6 * 4 and shared["results"]["tpot_ms"]["count"] == 6
    # goodput agrees with the per-request records and the SLOs given
    for rep in (shared, passkey):
        good = sum(1 for r in rep["requests"] if r["success"] and r["ttft"] * 1000 <= 60000
                   and (r["tpot"] is None or r["tpot"] * 1000 <= 5000))
        assert rep["results"]["goodput"]["good_requests"] == good
        assert rep["results"]["goodput"]["slos_ms"] == {"ttft": 60000.0, "tpot": 5000.0}
    # passkey answers were checked (the default model finds most keys; at least one must be right)
    answers = passkey["results"]["answers"]
    assert answers["checked"] == 2 and answers["correct"] >= 1, passkey["requests"]


def _value(api, expr: str) -> float:
    res = api.query(expr)
    assert res["status"] == "success", res
    return sum(float(s["value"][1]) for s in res["data"]["result"])


def test_server_counted_what_the_load_test_sent(load_run, prometheus):
    reports = (load_run["shared"], load_run["passkey"])
    requests = sum(r["results"]["successful"] for r in reports)
    prompt = sum(r["results"]["input_tokens"] for r in reports)
    generated = sum(r["results"]["output_tokens"] for r in reports)
    finished = 'sum(lserve:request_success_total{finished_reason=~"stop|length"})'
    prometheus.wait_for(finished, lambda r: r and float(r[0]["value"][1]) >= requests, timeout=30)
    assert _value(prometheus, finished) == requests
    assert _value(prometheus, 'sum(lserve:request_success_total{finished_reason=~"abort|error"})') == 0
    assert _value(prometheus, "sum(lserve:prompt_tokens_total)") == prompt
    assert _value(prometheus, "sum(lserve:generation_tokens_total)") == generated
    assert _value(prometheus, "sum(lserve:time_to_first_token_seconds_count)") == requests
    assert _value(prometheus, 'sum(lserve:http_responses_total{endpoint="/v1/completions", status="200"})') == requests


@pytest.mark.parametrize("query", dashboard_queries(), ids=lambda q: f"{q[0]}:{q[1]}")
def test_panel_query_returns_data(load_run, prometheus, query):
    name, title, expr = query
    res = prometheus.query_range(substitute(expr), load_run["start"] - 2, load_run["end"], step=1)
    assert res.get("status") == "success", f"{title}: {res}"
    assert finite_points(res) > 0, f"{title}: no data for {substitute(expr)!r} during the load test"


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r.get("alert") or r.get("record"))
def test_alert_expression_parses_in_prometheus(prometheus, rule):
    res = prometheus.query(rule["expr"])
    assert res.get("status") == "success", res


def test_prometheus_evaluates_every_rule_without_error(load_run, prometheus):
    groups = prometheus.get("/api/v1/rules")["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(rules) == {r["alert"] for r in alert_rules()}
    for name, r in rules.items():
        assert r["health"] == "ok", f"{name}: {r.get('lastError')}"
        assert r["lastEvaluation"] != "0001-01-01T00:00:00Z"
    # Engines report, so the "no engine metrics" alert stays quiet.
    assert rules["LServeNoEngineMetrics"]["state"] == "inactive"


def _series(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_metrics_sidecar_serves_what_the_ingress_serves(load_run, lserve_server):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(DEPLOY / "metrics_exporter.py"), "--root",
                             str(lserve_server.metrics_root), "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert "lserve metrics exporter" in proc.stdout.readline()
        with urllib.request.urlopen(f"{lserve_server.url}/metrics", timeout=30) as resp:
            ingress = _series(resp.read().decode())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            sidecar = _series(resp.read().decode())
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert ingress and set(sidecar) == set(ingress)
    steady = [k for k in ingress if "_total" in k or "_count" in k or "_bucket" in k]
    assert steady and all(sidecar[k] == ingress[k] for k in steady if "engine_steps" not in k)
