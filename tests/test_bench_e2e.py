"""``lserve bench e2e`` on the CPU with the tiny preset: the report has the issue's schema."""

from __future__ import annotations

import json
import subprocess
import sys


def test_e2e_report_schema(tmp_path):
    cmd = [sys.executable, "-m", "lserve", "bench", "e2e", "--model", "tiny", "--device", "cpu", "--backend", "torch",
           "--contexts", "256", "512", "--decode-tokens", "4", "--batched", "2x256", "--out", str(tmp_path),
           "--name", "t"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "t.json").read_text())
    assert {"command", "device", "date", "weight_floor_ms", "rows", "max_context_tokens"} <= set(rep)
    got = {(row["config"], row["batch"], row["context"]) for row in rep["rows"]}
    for c in ("dense", "static", "dynamic", "lserve", "transformers"):
        assert {(c, 1, 256), (c, 1, 512)} <= got, c
    assert {("dense", 2, 256), ("lserve", 2, 256)} <= got
    for row in rep["rows"]:
        assert row["ttft_s"] > 0 and row["decode_ms_per_token"] > 0 and row["model"] == "tiny"
    assert (tmp_path / "t.png").stat().st_size > 0
    bad = subprocess.run(cmd[:-2] + ["--batched", "8by4"], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "--batched must look like" in bad.stderr and "Traceback" not in bad.stderr


def test_e2e_adaptive_budgets_rows(tmp_path):
    """``--adaptive-budgets resampled``: an ``lserve-adaptive`` row beside ``lserve`` at the same mean
    (4096 tokens), run from the default model's ratios resampled to the preset's layers and written
    beside the report; the summary compares the two."""
    from lserve.sparsity.adaptive_budget import load_ratios

    ctx = 6144  # past the 4096 budget, so the layers select
    cmd = [sys.executable, "-m", "lserve", "bench", "e2e", "--model", "tiny", "--device", "cpu", "--backend", "torch",
           "--contexts", str(ctx), "--decode-tokens", "4", "--batched", "none", "--no-hf", "--side-max-context", "1",
           "--adaptive-budgets", "resampled", "--out", str(tmp_path), "--name", "a"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "a.json").read_text())
    rows = {row["config"]: row for row in rep["rows"]}
    assert set(rows) == {"dense", "lserve", "lserve-adaptive"}
    ad = rep["adaptive_budgets"]
    assert ad["resampled"] is True and ad["resampled_from"] == "lserve/patterns/smollm2-135m/adaptive_budgets.json"
    assert ad["source_layers"] == 30 and ad["mean_budget"] == 4096
    assert load_ratios(tmp_path / ad["file"], 4) == tuple(ad["ratios"])
    # what the engine ran: per-layer tokens around the uniform row's mean, whole pages (64) rounded down
    layers = [(n, t) for n, t in zip(ad["dense_heads"], ad["layer_tokens"]) if n]
    assert len({t for _, t in layers}) > 1 and all(t % 64 == 0 for _, t in layers)
    assert 4096 - 64 <= ad["weighted_mean_tokens"] <= 4096
    # bytes read differ from the uniform row's (a layer past the context reads only the context)
    assert rows["dense"]["kv_read_fraction"] == 1.0
    assert 0 < rows["lserve-adaptive"]["kv_read_fraction"] < 1 and 0 < rows["lserve"]["kv_read_fraction"] < 1
    assert rows["lserve-adaptive"]["kv_read_fraction"] != rows["lserve"]["kv_read_fraction"]
    x = round(rows["lserve-adaptive"]["decode_ms_per_token"] / rows["lserve"]["decode_ms_per_token"], 3)
    assert ad["decode_adaptive_over_uniform"] == {str(ctx): x}
    assert f"decode {ctx} lserve-adaptive/lserve ms per token: {x} (target <= 1.05)" in r.stdout


def test_e2e_adaptive_budgets_refusals(tmp_path):
    base = [sys.executable, "-m", "lserve", "bench", "e2e", "--model", "tiny", "--device", "cpu", "--backend", "torch",
            "--contexts", "256", "--batched", "none", "--no-hf", "--out", str(tmp_path), "--adaptive-budgets"]
    for spec, why in (("auto", "no shipped adaptive budgets for model 'tiny'"),
                      (str(tmp_path / "missing.json"), "cannot read adaptive budgets")):
        r = subprocess.run(base + [spec], capture_output=True, text=True, timeout=600)
        err = r.stderr.strip().splitlines()
        assert r.returncode == 2 and err[-1].startswith("lserve: error: ") and why in err[-1], r.stderr
        assert "Traceback" not in r.stderr and not list(tmp_path.glob("*.json"))
