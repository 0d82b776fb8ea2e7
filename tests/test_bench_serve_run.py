"""``lserve bench serve`` end to end on the CPU (tiny model, real servers): workloads from a plan,
load points of a minimum length and request count, the roofline bound, goodput, and the
``--itl-slo-ms`` sweep with its trade-off plot."""

from __future__ import annotations

import json

import pytest
from ports import free_port

from lserve.bench.serve import bound_tok_s, parse_plan, served_itl_slo_ms, served_stream_interval
from lserve.bench.serve_plots import sweep_curve
from lserve.cli import main


def test_plan_entries_and_their_errors():
    assert parse_plan(["reasoning:131072:4", "random:2048:1,16,32:512", "doc-qa:32768:1"], 64) == [
        ("reasoning", 131072, [4], 2048), ("random", 2048, [1, 16, 32], 512), ("doc-qa", 32768, [1], 128)]
    assert parse_plan(["random:2048:1"], 64) == [("random", 2048, [1], 64)]
    for bad in ("poetry:2048:1", "random:2048", "random:x:1", "random:2048:0", "random:8:1"):
        with pytest.raises(ValueError):
            parse_plan([bad], 64)


def test_bad_bench_flags_are_one_line_errors(capsys):
    assert main(["bench", "serve", "--plan", "random:2048"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lserve: error: --plan") and err.count("\n") == 1
    assert main(["bench", "serve", "--configs", "lserve,sparse"]) == 2
    assert main(["bench", "serve", "--sweep-point", "4"]) == 2
    assert main(["bench", "serve", "--itl-slo-sweep", "-5"]) == 2
    assert main(["bench", "serve", "--decode-step-min-c", "0"]) == 2
    assert main(["bench", "serve", "--stream-intervals", "1", "0"]) == 2
    assert main(["bench", "serve", "--sweep-configs", "lserve,fast"]) == 2
    err = capsys.readouterr().err
    assert err.count("lserve: error: ") == 6 and "--stream-intervals values must be >= 1" in err
    assert "--sweep-configs: unknown configuration 'fast'" in err


def test_server_flags_may_be_given_more_than_once(monkeypatch, tmp_path):
    """Each ``--server-flags`` string is split into ``lserve serve`` flags; several add up (a shell
    variable that holds the bench's arguments can carry one ``--server-flags=...`` per flag)."""
    import lserve.bench.serve as serve_bench

    seen = {}
    monkeypatch.setattr(serve_bench, "run_serve_bench", lambda out, **kw: seen.update(kw) or {"rows": []})
    argv = ["bench", "serve", "--plan", "doc-qa:32768:1", "--out", str(tmp_path),
            "--server-flags=--max-batched-tokens=16384", "--server-flags", "--step-time-target 0.5"]
    main(argv)
    assert seen["extra_flags"] == ("--max-batched-tokens=16384", "--step-time-target", "0.5")


def test_the_bound_is_a_round_of_prefills_and_pure_decode_steps():
    """C * n / (C * P + (n - 1) * d): P the smaller of the concurrency-1 row's TTFT and the
    engine's, d the measured pure decode step at batch C (never the row's ITL); no d, no bound."""
    rows = [{"config": "lserve", "workload": "random", "context": 2048, "output_len": 512, "concurrency": c,
             "ttft_p50_s": t, "itl_p50_ms": itl} for c, t, itl in ((1, 0.066, 4.7), (32, 1.2, 21.0))]
    rows.append({"config": "lserve", "workload": "reasoning", "context": 131072, "output_len": 2048, "concurrency": 4,
                 "ttft_p50_s": 30.0, "itl_p50_ms": 8.0})
    rows.append({"config": "dense", "workload": "reasoning", "context": 131072, "output_len": 2048, "concurrency": 4,
                 "ttft_p50_s": 50.0, "itl_p50_ms": 60.0})
    steps = {"lserve": {"2048": {"1": 4.2, "32": 9.5}, "131072": {"4": 6.0}}, "dense": {"131072": {"1": 9.0}}}
    bound_tok_s(rows, {"lserve": {"131072": 7.15, "2048": 0.08}}, steps)
    assert rows[0]["bound_tok_s"] == pytest.approx(512 / (0.066 + 511 * 0.0042), rel=1e-3)
    assert rows[1]["bound_tok_s"] == pytest.approx(32 * 512 / (32 * 0.066 + 511 * 0.0095), rel=1e-3)
    assert rows[2]["bound_tok_s"] == pytest.approx(4 * 2048 / (4 * 7.15 + 2047 * 0.006), rel=1e-3)
    assert [r["decode_step_ms"] for r in rows] == [4.2, 9.5, 6.0, None]
    assert rows[3]["bound_tok_s"] is None  # its ITL is there, its batch-4 decode step is not
    old = [dict(r, decode_step_ms=None) for r in rows]
    bound_tok_s(old)  # a report from before decode_step_ms: no bound rather than a wrong one
    assert all(r["bound_tok_s"] is None for r in old)


def test_the_trade_off_curve_takes_the_plan_row_at_the_sweep_point():
    """A plan row at the sweep's point is the curve's point at the default SLO, unless the sweep
    served that SLO itself; other plan rows stay out."""
    def row(config, ctx, slo, ttft=10.0, c=4):
        return {"config": config, "workload": "reasoning", "context": ctx, "concurrency": c, "output_len": 256,
                "itl_slo_ms": slo, "ttft_p50_s": ttft, "itl_p99_ms": 90.0}
    plan = [row("lserve", 131072, 100.0), row("dense", 131072, 100.0), row("lserve", 32768, 100.0),
            row("lserve", 131072, 100.0, c=1)]
    sweep = [row("lserve", 131072, 0.0), row("lserve", 131072, 200.0), row("dense", 131072, 100.0, ttft=None)]
    curve = sweep_curve({"rows": plan, "itl_sweep": sweep})
    assert sorted((r["config"], r["itl_slo_ms"]) for r in curve) == [("lserve", 0.0), ("lserve", 100.0),
                                                                     ("lserve", 200.0)]
    assert sweep_curve({"rows": plan, "itl_sweep": sweep[:2]})[-1]["config"] == "dense"


def test_served_itl_slo_is_the_last_flag_or_the_default():
    assert served_itl_slo_ms(["--model", "tiny"]) == 100.0
    assert served_itl_slo_ms(["--itl-slo-ms", "50", "--itl-slo-ms", "0"]) == 0.0
    assert served_stream_interval(["--model", "tiny"]) == 1
    assert served_stream_interval(["--stream-interval", "4", "--stream-interval=2"]) == 2



def test_bench_serve_on_the_cpu(tmp_path, monkeypatch):
    """Two load points of the reasoning workload (16 output tokens here) served at stream
    intervals 1 and 4, and an ITL SLO sweep of two values at concurrency 2, through real ``lserve
    serve`` processes, which inherit an API key from the environment (the bench's clients send it)."""
    monkeypatch.setenv("LSERVE_API_KEY", "bench-key")
    argv = ["bench", "serve", "--model", "tiny", "--device", "cpu", "--backend", "torch", "--configs", "lserve",
            "--plan", "reasoning:96:1,2:16", "--stream-intervals", "1", "4",
            "--point-time", "2", "--requests-per-c", "3", "--no-engine-ttft",
            "--itl-slo-sweep", "0", "40", "--sweep-configs", "lserve", "--sweep-point", "96:2",
            "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000",
            "--out", str(tmp_path), "--name", "cpu", "--port", str(free_port()), "--deadline", "600"]
    assert main(argv) == 0
    rep = json.loads((tmp_path / "cpu.json").read_text())
    rows = rep["rows"]
    assert [(r["workload"], r["context"], r["concurrency"], r["output_len"], r["stream_interval"]) for r in rows] == [
        ("reasoning", 96, 1, 16, 1), ("reasoning", 96, 2, 16, 1), ("reasoning", 96, 1, 16, 4),
        ("reasoning", 96, 2, 16, 4)]
    # 16 tokens at interval 4: the first alone, then chunks of 4 (more where outputs queued up; at
    # interval 1 too on a loaded machine, so only interval 4's lower bound is checked); throughput
    # and TPOT count tokens (usage), not chunks
    assert all(r["tokens_per_chunk"] >= 16 / 5 for r in rows[2:]) and all(r["tokens_per_chunk"] >= 1 for r in rows)
    for r in rows:
        # where the replica's steps went (from /admin/engines, read before and after the point)
        kinds = r["step_time"]["kinds"]
        assert sum(k["steps"] for k in kinds.values()) > 0 and all(k["mean_ms"] > 0 for k in kinds.values()), r
        assert r["step_time"]["budget"]["rate"] > 0
        assert 0 <= r["replica"]["itl_above_slo"] <= 1  # the replica's own ITL samples past the 100 ms SLO
        assert r["failed"] == 0 and r["cancelled_at_limit"] == 0
        assert r["completed"] >= 3 * r["concurrency"] and r["duration_s"] >= 2.0  # both minimums held
        assert r["itl_slo_ms"] == 100.0
        # an upper bound: the engine's own decode step at this batch, not the served ITL
        assert r["decode_step_ms"] == rep["decode_step_ms"]["lserve"]["96"][str(r["concurrency"])] > 0
        # (10% slack: the bound's step and the served run are timed apart on a shared CPU)
        assert r["bound_tok_s"] >= 0.9 * r["output_tok_s"] > 0
        assert r["slo"] == {"ttft_ms": 60000.0, "itl_ms": 60000.0} and r["good_requests"] == r["completed"]
    assert rep["point_time_s"] == 2.0 and rep["requests_per_c"] == 3
    sweep = rep["itl_sweep"]
    assert [(r["itl_slo_ms"], r["concurrency"], r["context"]) for r in sweep] == [(0.0, 2, 96), (40.0, 2, 96)]
    assert all(r["completed"] >= 6 and r["ttft_p50_s"] and r["itl_p99_ms"] for r in sweep)
    assert all(r["bound_tok_s"] >= 0.9 * r["output_tok_s"] for r in sweep)
    assert set(rep["startup_s"]) == {"lserve@si1", "lserve@si4", "lserve@itl0", "lserve@itl40"}
    assert (tmp_path / "cpu.png").stat().st_size > 0 and (tmp_path / "cpu_itl_slo.png").stat().st_size > 0


def test_step_time_splits_a_points_steps_by_kind():
    """The per-point step breakdown: counters of two replicas read before and after, the prefill part
    of mixed steps split from the rest where it was timed apart, kinds without new steps left out."""
    from lserve.bench.serve_readings import step_line, step_time

    before = [{"replica": "a", "step_kinds": {"graph": 10, "prefill": 2}, "step_seconds": {"graph": [0.05, 0.0],
                                                                                          "prefill": [1.0, 0.0]}}]
    after = [{"replica": "a", "step_kinds": {"graph": 20, "prefill": 2, "mixed_graph": 4},
              "step_seconds": {"graph": [0.1, 0.0], "prefill": [1.0, 0.0], "mixed_graph": [0.4, 0.3]},
              "budget": {"rate": 5.0}},
             {"replica": "b", "step_kinds": {"graph": 2}, "step_seconds": {"graph": [0.02, 0.0]}, "budget": {}}]
    st = step_time(before, after)
    assert st["kinds"] == {"graph": {"steps": 12, "mean_ms": 5.83},
                           "mixed_graph": {"steps": 4, "mean_ms": 100.0, "prefill_ms": 75.0, "rest_ms": 25.0}}
    assert st["budget"] == {"rate": 5.0}
    assert step_line(st) == "graph 12 x 5.83 ms, mixed_graph 4 x 100.0 ms (75.0 + 25.0)"
    assert step_time([], after) is None and step_line(None) == "n/a"
