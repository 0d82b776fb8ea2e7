"""The host-tier benchmark's CPU side: which runs it plans, its plot, its command line."""

from __future__ import annotations

import time

import pytest

from lserve.bench.host_tier import DECODE_STEPS, _measure, estimate_s, main, plan_runs, plot


def test_plan_runs_tier_where_the_host_holds_it_and_gpu_where_the_pool_fits():
    runs = plan_runs((1048576, 131072), gpu_bytes=60e9, bytes_per_token=70e3, host_bytes=100e9, resident_tokens=65536)
    assert [(r["mode"], r["context"]) for r in runs] == [("tier", 131072), ("gpu", 131072), ("tier", 1048576)]
    assert runs[0]["host_kv_gib"] > 131072 * 70e3 / 2**30 and runs[1]["host_kv_gib"] == 0.0


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"mode": "tier", "context": 131072, "decode_ms_per_token": 20.0},
            {"mode": "gpu", "context": 131072, "decode_ms_per_token": 15.0}]
    plot({"model": "llama3-8b", "device": "cpu", "date": "now", "command": "x", "rows": rows}, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_cli_needs_an_output_folder(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2 and "out" in capsys.readouterr().err


def test_estimate_scales_the_longest_measured_row_of_the_mode():
    rows = [{"mode": "tier", "context": 131072, "ttft_s": 10.0, "decode_ms_per_token": 6.0},
            {"mode": "gpu", "context": 131072, "ttft_s": 9.0, "decode_ms_per_token": 5.0},
            {"mode": "tier", "context": 262144, "cut": True, "prefilled_tokens": 1000, "prefill_s": 99.0}]
    tier512 = {"mode": "tier", "context": 524288}
    # 4x the context: half linear (4x), half quadratic (16x) -> 10x the prefill, 4x the decode step
    assert estimate_s(tier512, rows, setup_s=20) == pytest.approx(20 + 100 + DECODE_STEPS * 24e-3)
    assert estimate_s({"mode": "gpu", "context": 524288}, rows, setup_s=0) == pytest.approx(90 + DECODE_STEPS * 20e-3)
    assert estimate_s(tier512, [], setup_s=0) > estimate_s({"mode": "tier", "context": 131072}, [], setup_s=0) * 9


def test_measure_prints_each_chunk_and_cuts_at_the_deadline(capsys):
    from lserve.config import CacheConfig, EngineConfig
    from lserve.engine import LLMEngine
    from lserve.models.loader import load_model

    loaded = load_model("tiny", seed=3)
    eng = LLMEngine(EngineConfig(model="tiny", cache=CacheConfig(page_size=16, logical_page_size=4, num_pages=64),
                                 max_batched_tokens=64, prefix_cache=False), loaded)
    run = {"mode": "gpu", "context": 256}
    row = _measure(eng, run, time.perf_counter(), deadline_s=600)
    assert row["prefill_chunks"] >= 4 and row["ttft_s"] > 0 and row["decode_ms_per_token"] > 0
    assert capsys.readouterr().out.count(" chunk ") == row["prefill_chunks"]
    cut = _measure(eng, run, time.perf_counter() - 1, deadline_s=0)
    assert cut["cut"] and cut["prefill_chunks"] == 1 and cut["prefilled_tokens"] == 64
    assert not eng.has_unfinished() and eng.cache.all_free()
