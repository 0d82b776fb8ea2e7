"""The host-tier benchmark's CPU side: which runs it plans, its plot, its command line."""

from __future__ import annotations

import json
import time

import pytest

from lserve.bench.host_tier import _measure, main, plan_runs, plot


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
    assert row["decode_steps_run"] >= 32 and "profiled_steps" not in row
    assert row["decode_ms_max"] >= row["decode_ms_mean"] > 0 and row["decode_ms_max"] >= row["decode_ms_per_token"]
    assert capsys.readouterr().out.count(" chunk ") == row["prefill_chunks"]
    cut = _measure(eng, run, time.perf_counter() - 1, deadline_s=0)
    assert cut["cut"] and cut["prefill_chunks"] == 1 and cut["prefilled_tokens"] == 64
    assert not eng.has_unfinished() and eng.cache.all_free()


def test_measure_reports_the_kept_fraction_of_block_sparse_prefill():
    from lserve.config import CacheConfig, EngineConfig, SparsityConfig
    from lserve.engine import LLMEngine
    from lserve.models.loader import load_model

    sp = SparsityConfig(pattern="random", prefill_sparsity=0.3, prefill_sparsity_min_len=128, prefill_block=16,
                        prefill_q_block=64)
    eng = LLMEngine(EngineConfig(model="tiny", sparsity=sp, cache=CacheConfig(page_size=16, logical_page_size=4,
                                                                              num_pages=64),
                                 max_batched_tokens=128, prefix_cache=False), load_model("tiny", seed=3))
    row = _measure(eng, {"mode": "gpu", "context": 512}, time.perf_counter(), deadline_s=600, decode_steps=3)
    assert 0 < row["prefill_kept_fraction"] < 1


def _cli(tmp_path, *extra):
    return main([str(tmp_path), "--model", "tiny", "--device", "cpu", "--gpu-kv-gib", "0.01", "--contexts", "1024",
                 "--resident-tokens", "640", "--max-batched-tokens", "64", "--decode-steps", "3", *extra])


def test_cli_runs_both_modes_on_the_cpu_with_the_tier_reading_the_host(tmp_path, capsys):
    assert _cli(tmp_path, "--prefill-sparsity", "0") == 0
    report = json.loads((tmp_path / "host_tier_h200.json").read_text())
    assert report["prefill_sparsity"] == 0.0 and report["max_batched_tokens"] == 64
    tier, gpu = report["rows"]
    assert (tier["mode"], gpu["mode"]) == ("tier", "gpu") and tier["context"] == gpu["context"] == 1024
    assert tier["prefill_bytes_h2d"] > 0 and tier["prefill_chunks"] == 1024 // 64
    assert all(r["ttft_s"] > 0 and r["decode_ms_per_token"] > 0 and r["estimate_s"] > 0 for r in (tier, gpu))
    assert "prefill_kept_fraction" not in tier  # tau 0: no block-sparse prefill ran
    assert "(estimated" in capsys.readouterr().out


def test_cli_skips_runs_estimated_past_the_deadline(tmp_path, capsys):
    assert _cli(tmp_path, "--deadline", "0.5") == 0
    report = json.loads((tmp_path / "host_tier_h200.json").read_text())
    assert report["rows"] == [] and [r["mode"] for r in report["skipped"]] == ["tier", "gpu"]
    assert all(r["estimate_s"] >= 1 for r in report["skipped"]) and "skip tier 1024" in capsys.readouterr().out


def test_cli_runs_one_mode_under_its_own_name(tmp_path, monkeypatch):
    # Two resident sets at one context in one device call: each run its own report, no all-GPU rerun.
    from lserve.cache import tier_policy

    monkeypatch.setattr(tier_policy, "ADMIT_ON_REPEAT", True)  # restored after: the bench sets it
    assert _cli(tmp_path, "--deadline", "0.5", "--modes", "tier", "--name", "host_tier_r640", "--admission", "all") == 0
    report = json.loads((tmp_path / "host_tier_r640.json").read_text())
    assert [r["mode"] for r in report["skipped"]] == ["tier"] and not (tmp_path / "host_tier_h200.json").exists()
    assert report["admission"] == "all" and tier_policy.ADMIT_ON_REPEAT is False


@pytest.mark.parametrize("bad, why", [(["--prefill-sparsity", "2"], "prefill"), (["--prefill-sparsity", "x"], "prefill"),
                                      (["--contexts", "12k"], "contexts"), (["--max-batched-tokens", "0"], "batched"),
                                      (["--modes", "cpu"], "modes"), (["--name", "a/b"], "name"),
                                      (["--admission", "lfu"], "admission"), (["--profile-steps", "-1"], "profile"),
                                      (["--profile-steps", "8"], "profile")])
def test_cli_refuses_bad_settings_with_one_error_line(tmp_path, capsys, bad, why):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--device", "cpu", "--gpu-kv-gib", "1", *bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error:" in err and why in err and "Traceback" not in err


def test_cli_off_a_gpu_needs_the_device_memory_to_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--device", "cpu"])
    assert e.value.code == 2 and "--gpu-kv-gib" in capsys.readouterr().err


def test_cli_keeps_each_steps_kind_and_fetches_and_profiles_the_host(tmp_path, capsys):
    assert _cli(tmp_path, "--prefill-sparsity", "0", "--modes", "tier", "--host-profile-steps", "2") == 0
    (row,) = json.loads((tmp_path / "host_tier_h200.json").read_text())["rows"]
    assert len(row["decode_step_kind"]) == len(row["decode_step_fetched"]) == len(row["decode_step_ms"]) == 3
    assert set(row["decode_step_kind"]) == {"decode_eager"}  # the torch backend has no CUDA graphs
    assert all(n >= 0 for n in row["decode_step_fetched"]) and sum(row["decode_step_fetched"]) <= row["fetched"]
    assert row["host_profiled_steps"] == 2 and row["decode_steps_run"] >= 3 + 2
    own = row["host_tottime_ms_per_step"]
    assert len(own) > 5 and all(v >= 0 for v in own.values())
    # the step is under everything the profile saw: LLMEngine.step tops the cumulative list
    assert any(k.endswith(":step") for k in list(row["host_cumtime_ms_per_step"])[:3])
    assert "cProfile 2 decode steps" in capsys.readouterr().out
