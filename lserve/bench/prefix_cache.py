"""CPU benchmark of the prefix cache behind the router: ``benchmarks/prefix_cache_cpu.json``.

Two engine replicas of the default model in a local Ray Serve app, driven over HTTP by the
``load_tests`` document-QA workload (N documents x M questions, Poisson arrivals, streamed):

1. prefix cache on, LServe's prefix router: hit rate = ``prefix_cache_hits / prefix_cache_queries``
   summed over replicas from ``/metrics`` (prompt tokens, vLLM's meaning); mean TTFT of follow-up
   questions (question >= 1);
2. the same with Ray Serve's default (power-of-two-choices) router: its hit rate;
3. prefix cache off (``--no-prefix-cache``), prefix router: mean TTFT of the same follow-ups.

Run from the repository root (``load_tests`` is imported from there)::

    python -m lserve.bench.prefix_cache --docs 8 --questions 6 --doc-len 4500 --rate 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

APP = "lserve-prefix-bench"


def _log(msg: str) -> None:
    print(f"[bench prefix-cache {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(url: str) -> dict[str, float]:
    """Totals over replicas of the prefix-cache counters on ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {"queries": 0.0, "hits": 0.0}
    for fam in text_string_to_metric_families(text):
        for key in out:
            if fam.name == f"lserve:prefix_cache_{key}":
                out[key] += sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return out


def _wait_healthy(url: str, timeout_s: float = 900.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2.0)
    raise RuntimeError(f"the app was not healthy after {timeout_s:.0f} s")


def run_config(name: str, settings_kw: dict, specs, rate: float, time_limit_s: float) -> dict:
    """Start the app with these settings, offer the workload, read the counters, stop the app."""
    from ray import serve

    from load_tests.client import RequestOptions
    from load_tests.runner import LoadShape, run_load
    from lserve.serve.app import build_app_from_settings
    from lserve.serve.settings import ServeSettings

    port = _free_port()
    settings = ServeSettings(app_name=APP, **settings_kw)
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    serve.run(build_app_from_settings(settings, total_cpus=2), name=APP, route_prefix="/",
              logging_config={"log_level": "WARNING", "enable_access_log": False})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url)
        _log(f"{name}: sending {len(specs)} requests at {rate}/s")
        opts = RequestOptions(url=url + "/v1/completions", model=settings.model_name, temperature=0.0,
                              ignore_eos=True, timeout_s=time_limit_s)
        t0 = time.perf_counter()
        results, _, not_sent = asyncio.run(run_load(specs, opts, LoadShape("poisson", rate=rate, seed=1),
                                                    time_limit_s, progress=False))
        wall = time.perf_counter() - t0
        time.sleep(3.0)  # replicas export counters every second
        counters = _scrape(url)
    finally:
        serve.shutdown()
        if settings.metrics_dir:
            shutil.rmtree(settings.metrics_dir, ignore_errors=True)
    follow = [r.ttft for r, s in zip(results, specs) if s.meta["question"] > 0 and r.success]
    first = [r.ttft for r, s in zip(results, specs) if s.meta["question"] == 0 and r.success]
    failed = sum(not r.success for r in results) + not_sent
    row = {"config": name, "requests": len(specs), "failed": failed, "wall_s": round(wall, 1),
           "prefix_cache_queries": counters["queries"], "prefix_cache_hits": counters["hits"],
           "hit_rate": round(counters["hits"] / counters["queries"], 4) if counters["queries"] else 0.0,
           "ttft_first_mean_s": round(sum(first) / len(first), 3) if first else None,
           "ttft_followup_mean_s": round(sum(follow) / len(follow), 3) if follow else None}
    _log(json.dumps(row))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lserve.bench.prefix_cache", description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--doc-len", type=int, default=4500, help="mean document tokens (uniform +- 1/3: 3k-6k)")
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--rate", type=float, default=0.05, help="Poisson arrivals, requests per second")
    p.add_argument("--time-limit", type=float, default=7200.0)
    p.add_argument("--configs", nargs="+", default=["prefix", "default", "off"], choices=["prefix", "default", "off"])
    p.add_argument("--out", default="benchmarks/prefix_cache_cpu.json")
    a = p.parse_args(argv)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from load_tests.datasets import doc_qa_dataset, load_tokenizer

    tok = load_tokenizer("default")
    specs = doc_qa_dataset(tok, a.docs, a.questions, a.doc_len, 1 / 3, a.question_len, a.output_len, seed=0)
    max_len = max(s.input_len for s in specs) + a.output_len
    base = {"device": "cpu", "replicas": 2, "num_cpus": 0.9, "ingress_num_cpus": 0.1, "torch_threads": 1,
            "max_num_seqs": 8, "max_ongoing_requests": 16, "max_queued_requests": 256,
            "max_model_len": max(2048, max_len), "max_cache_tokens": 65536, "routing_stats_period_s": 1.0}
    configs = {"prefix": ("prefix router, cache on", {}),
               "default": ("Ray Serve default router, cache on", {"request_router": "default"}),
               "off": ("prefix router, cache off", {"prefix_cache": False})}
    tmp = tempfile.mkdtemp(prefix="lsp-", dir="/tmp")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=tmp, logging_level="WARNING",
             namespace="lserve-bench")
    rows = {}
    try:
        for key in a.configs:
            name, extra = configs[key]
            rows[key] = run_config(name, {**base, **extra}, specs, a.rate, a.time_limit)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    report = {
        "command": "python -m lserve.bench.prefix_cache " + " ".join(argv if argv is not None else sys.argv[1:]),
        "workload": {"docs": a.docs, "questions": a.questions, "doc_len_mean": a.doc_len,
                     "doc_lens": sorted({s.meta["doc_len"] for s in specs}), "question_len": a.question_len,
                     "output_len": a.output_len, "rate_per_s": a.rate, "model": "default (SmolLM2-135M)"},
        "settings": base, "runs": list(rows.values()),
        "hit_rate_prefix_router": rows["prefix"]["hit_rate"] if "prefix" in rows else None,
        "hit_rate_default_router": rows["default"]["hit_rate"] if "default" in rows else None,
        "ttft_cached_s": rows["prefix"]["ttft_followup_mean_s"] if "prefix" in rows else None,
        "ttft_uncached_s": rows["off"]["ttft_followup_mean_s"] if "off" in rows else None,
    }
    if report["ttft_cached_s"] and report["ttft_uncached_s"]:
        report["ttft_speedup"] = round(report["ttft_uncached_s"] / report["ttft_cached_s"], 2)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    _log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
