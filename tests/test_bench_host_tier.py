"""The host-tier benchmark's CPU side: which runs it plans, its plot, its command line."""

from __future__ import annotations

import pytest

from lserve.bench.host_tier import main, plan_runs, plot


def test_plan_runs_tier_where_the_host_holds_it_and_gpu_where_the_pool_fits():
    runs = plan_runs((131072, 1048576), gpu_bytes=60e9, bytes_per_token=70e3, host_bytes=100e9, resident_tokens=65536)
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
