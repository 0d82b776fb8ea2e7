"""The host KV tier's series on ``/metrics`` (issue 39): a real ``lserve serve`` (default model, one
CPU replica) whose device holds few more dense pages than one step pins, so a long prompt's pages
are spilled to the host, prefill chunks read their past back from it and decode's page selection
misses and fetches. Before traffic the tier's counters are exported at zero; after one request
its gauges and counters show the spills, host reads, fetches, hits and misses."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import httpx
from ports import free_port
from test_metrics import scrape, total
from test_shutdown import _wait_for, served

#: 256-token steps and 2 sequences with a 2 + 5 page window (64-token pages) pin 4 + 2 * 8 = 20
#: pages; the device holds 24, the host 109 (default model: ~1.5 MB a page over all layers).
FLAGS = ["--device", "cpu", "--replicas", "1", "--max-num-seqs", "2", "--max-batched-tokens", "256",
         "--max-cache-tokens", "1536", "--host-kv-gib", "0.15", "--max-model-len", "2048", "--token-budget", "256",
         "--reuse-interval", "1", "--shutdown-grace-s", "1"]
DOC = " ".join(f"Box {i} holds {['red', 'blue', 'green', 'black'][i % 4]} marbles." for i in range(200))

COUNTERS = ("hits", "misses", "pages_fetched", "pages_streamed", "pages_spilled", "bytes_h2d", "bytes_d2h")
GAUGES = ("pages_on_host", "host_pages", "resident_slots_used", "resident_slots", "hot_pages")


def test_host_tier_series_move_on_metrics(tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    ray_tmp = tempfile.mkdtemp(prefix="lsh-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k not in ("LSERVE_API_KEY", "RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp, LSERVE_LOG="WARNING")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lserve.cli", "serve", "--port", str(port), *FLAGS],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    app = SimpleNamespace(url=f"http://127.0.0.1:{port}")
    with served(proc, app.url, log, ray_tmp):
        _, fams = scrape(app)
        # Before any request: the counters exist at zero, the capacity gauges are set.
        for c in COUNTERS:
            assert total(fams[f"lserve:host_kv_{c}"], "_total") == 0, c
        _wait_for(lambda: "lserve:host_kv_resident_slots" in scrape(app)[1], 10, "no host-tier gauges after 10 s")
        r = httpx.post(f"{app.url}/v1/completions", timeout=300,
                       json={"prompt": DOC + " Q: which colour are the marbles in box 37? A:", "max_tokens": 8,
                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 1536  # more than the device holds
        _wait_for(lambda: total(scrape(app)[1]["lserve:host_kv_hits"], "_total") > 0, 10, "no hits exported")
        _, fams = scrape(app)
        admin = httpx.get(f"{app.url}/admin/engines", timeout=30).json()["replicas"]
        assert all(r["host_kv"]["spilled"] > 0 and r["host_kv"]["host_pages"] > 0 for r in admin), admin

    value = {c: total(fams[f"lserve:host_kv_{c}"], "_total") for c in COUNTERS}
    value.update({g: total(fams[f"lserve:host_kv_{g}"]) for g in GAUGES})
    value.update({g: total(fams[f"lserve:host_kv_{g}"]) for g in ("hit_rate", "bytes_h2d_per_step")})
    steps = total(fams["lserve:engine_steps"], "_total")
    assert value["pages_spilled"] > 0 and value["bytes_d2h"] > 0 and value["pages_on_host"] > 0, value
    assert value["pages_streamed"] + value["pages_fetched"] > 0 and value["bytes_h2d"] > 0, value
    assert value["misses"] > 0 and value["hits"] > 0 and 0 <= value["hit_rate"] <= 1, value
    assert 0 < value["resident_slots_used"] <= value["resident_slots"] == 24 * 30, value  # 30 layers
    assert value["pages_on_host"] <= value["host_pages"], value
    # The ratio gauges cover the last export interval with traffic (their mapping: test_host_kv_metric_mapping.py).
    assert steps > 0 and value["bytes_h2d_per_step"] >= 0, value
    for s in fams["lserve:host_kv_pages_on_host"].samples:
        assert s.labels["model"] == "default" and s.labels["replica"], s
