"""``lserve bench serve --merge``: runs measured in separate device calls become one report."""

import json

from lserve.cli import main


def _run(tmp_path, name, config_rows, engine, hol, by_config=None):
    rows = [{"config": c, "context": ctx, "concurrency": conc, "output_len": 128, "output_tok_s": tps,
             "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "itl_p50_ms": 5.0, "itl_p99_ms": 7.0, "completed": 4, "failed": 0}
            for c, ctx, conc, tps in config_rows]
    report = {"command": f"run {name}", "date": "2026-12-01", "device": "H200", "wall_s": 100.0, "output_len": 128,
              "rows": rows, "engine_ttft_s": engine, "hol": hol, "hol_repeat": hol and {**hol, "repeat": True},
              "steps": {"lserve": {"graph": 3}},
              "startup_s": {"lserve": 30.0}, "engine_ttft_by_config": by_config or {}}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(report))
    return str(path)


def test_merge_joins_rows_and_keeps_the_long_run_figures(tmp_path):
    a = _run(tmp_path, "short", [("lserve", 2048, 1, 190.0), ("dense", 2048, 1, 200.0)], {}, None,
             {"lserve-sparse": {"131072": 5.0}})
    b = _run(tmp_path, "long", [("lserve", 32768, 1, 30.0)], {"32768": 1.2}, {"short_ttft_s": 0.3},
             {"lserve": {"32768": 1.2}, "lserve-sparse": {"32768": 1.1}})
    assert main(["bench", "serve", "--merge", a, b, "--out", str(tmp_path), "--name", "joined"]) == 0
    out = json.loads((tmp_path / "joined.json").read_text())
    assert [(r["config"], r["context"]) for r in out["rows"]] == [("lserve", 2048), ("dense", 2048), ("lserve", 32768)]
    assert out["engine_ttft_s"] == {"32768": 1.2}
    assert out["engine_ttft_by_config"] == {"lserve": {"32768": 1.2}, "lserve-sparse": {"131072": 5.0, "32768": 1.1}}
    assert out["hol"] == {"short_ttft_s": 0.3}
    assert out["hol_repeat"] == {"short_ttft_s": 0.3, "repeat": True}
    assert [r["command"] for r in out["runs"]] == ["run short", "run long"]
    assert set(out["steps"]) == {"lserve@0", "lserve@1"}
    assert (tmp_path / "joined.png").stat().st_size > 0


def test_replica_means_from_prometheus_text():
    """The per-point replica-side means come from /metrics histogram deltas, every replica's label set added."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from lserve.bench.serve_readings import REPLICA_SIDE, histogram_totals, replica_means

    reg = CollectorRegistry()
    hs = {k: Histogram(n, k, ("replica",), registry=reg) for k, n in REPLICA_SIDE.items()}
    hs["ttft"].labels(replica="a").observe(1.0)
    before = histogram_totals(generate_latest(reg).decode(), REPLICA_SIDE.values())
    hs["ttft"].labels(replica="a").observe(2.0)
    hs["ttft"].labels(replica="b").observe(4.0)
    hs["queue"].labels(replica="b").observe(0.5)
    after = histogram_totals(generate_latest(reg).decode(), REPLICA_SIDE.values())
    assert after[REPLICA_SIDE["ttft"]] == (7.0, 3.0)
    assert replica_means(before, after) == {"ttft_mean_s": 3.0, "queue_mean_s": 0.5, "prefill_mean_s": None}
    assert replica_means({}, after) == {"ttft_mean_s": None, "queue_mean_s": None, "prefill_mean_s": None}


def test_replica_itl_share_above_the_slo_from_bucket_deltas():
    """The share of a point's replica-side ITL samples above the SLO: bucket deltas of every
    replica's label set, at the smallest bucket bound that is at least the SLO."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from lserve.bench.serve_readings import REPLICA_ITL, bucket_counts, share_above
    from lserve.serve.metrics import TOKEN_BUCKETS

    reg = CollectorRegistry()
    h = Histogram(REPLICA_ITL.removesuffix("_seconds"), "itl", ("replica",), registry=reg, buckets=TOKEN_BUCKETS,
                  unit="seconds")
    h.labels(replica="a").observe(0.5)  # before the point: not counted
    before = generate_latest(reg).decode()
    for x in (0.006, 0.09, 0.099, 0.12):
        h.labels(replica="a").observe(x)
    for x in (0.007, 0.3, 0.004, 0.05):
        h.labels(replica="b").observe(x)
    after = generate_latest(reg).decode()
    assert bucket_counts(after, REPLICA_ITL)[float("inf")] == 9
    assert share_above(before, after, REPLICA_ITL, 0.1) == 0.25  # 0.12 and 0.3 of 8
    assert share_above(before, after, REPLICA_ITL, 0.09) == 0.25  # the 0.1 bucket: the SLO's bound rounds up
    assert share_above("", after, REPLICA_ITL, 0.1) is None and share_above(after, after, REPLICA_ITL, 0.1) is None
