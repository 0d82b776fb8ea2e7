"""The kernel benchmarks time the layer of the preset given by ``--model`` (qwen2.5-7b: 28 query /
4 KV heads, GQA group 7), default llama3-8b as before. No GPU here: the timed functions are
replaced by recorders, so these tests check what shape reaches them, not the timings."""

from __future__ import annotations

import json

import pytest
import torch

import lserve.bench.bsp_prefill as bsp_bench
import lserve.bench.kernels as kernels
from lserve.cli import main as lserve_main
from lserve.config import ConfigError
from lserve.models.presets import layer_config


def test_layer_config_has_the_presets_attention_shape():
    q = layer_config("qwen2.5-7b")
    assert (q.num_heads, q.num_kv_heads, q.head_dim, q.group_size, q.num_layers) == (28, 4, 128, 7, 1)
    ll = layer_config("llama3-8b")
    assert (ll.num_heads, ll.num_kv_heads, ll.head_dim, ll.name) == (32, 8, 128, "llama3-8b-layer")
    with pytest.raises(ConfigError, match="unknown preset 'qwen9'.*qwen2.5-7b"):
        layer_config("qwen9")


def test_kernels_bench_model_flag_reaches_decode_and_prefill_rows(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "header", lambda: {"device": "test"})
    monkeypatch.setattr(kernels, "copy_bandwidth_tbps", lambda: 4.0)
    monkeypatch.setattr(kernels, "_plot", lambda report, png: None)
    monkeypatch.setattr(kernels, "_decode_row", lambda mc, ctx, bw: seen.append(("decode", mc, ctx)) or {"context": ctx})
    monkeypatch.setattr(kernels, "_prefill_row", lambda mc, ctx: seen.append(("prefill", mc, ctx)) or {"context": ctx})
    assert lserve_main(["bench", "kernels", "--model", "qwen2.5-7b", "--out", str(tmp_path)]) == 0
    assert [(k, c) for k, _, c in seen] == ([("decode", c) for c in kernels.DECODE_CONTEXTS]
                                            + [("prefill", c) for c in kernels.PREFILL_CONTEXTS])
    assert {(mc.num_heads, mc.num_kv_heads, mc.head_dim) for _, mc, _ in seen} == {(28, 4, 128)}
    report = json.loads((tmp_path / "kernels_qwen2.5-7b_h200.json").read_text())
    assert report["model"] == "qwen2.5-7b" and report["config"]["streaming_heads"] == "2 of 4"
    assert "28 q heads, 4 KV heads (GQA group 7), head_dim 128" in report["config"]["model"]
    # The decode rows' two layouts and the cache sizing follow the shape too.
    mc = seen[0][1]
    assert [n for n, _ in kernels.head_splits(mc)] == [4, 2]
    assert kernels._kv_bytes(mc, 1024) == 1024 * 4 * 128 * 2 * 2
    seen.clear()
    assert lserve_main(["bench", "kernels", "--out", str(tmp_path)]) == 0  # default: llama3-8b, file name as before
    assert {(mc.num_heads, mc.num_kv_heads) for _, mc, _ in seen} == {(32, 8)}
    assert json.loads((tmp_path / "kernels_h200.json").read_text())["config"]["streaming_heads"] == "4 of 8"


def test_kernels_bench_unknown_model_is_one_error_line(capsys):
    assert lserve_main(["bench", "kernels", "--model", "qwen9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lserve: error: --model: unknown preset 'qwen9'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_kernels_bench_without_a_gpu_is_one_error_line(capsys):
    assert lserve_main(["bench", "kernels"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA GPU" in err[0]


def test_bsp_prefill_model_flag_reaches_the_rows(tmp_path, monkeypatch):
    seen = []

    def row(shape, ctx, fractions, variants, iters):
        seen.append((shape, ctx, tuple(fractions)))
        return {"context": ctx, "fractions": []}

    monkeypatch.setattr(bsp_bench, "_row", row)
    monkeypatch.setattr(bsp_bench, "_plot", lambda report, png: None)
    rep = bsp_bench.run(str(tmp_path), contexts=(4096,), fractions=(0.3,), skip_parity=True, model="qwen2.5-7b")
    shape = seen[0][0]
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.dense_kv_heads, shape.group) == (28, 4, 128, 2, 7)
    assert seen == [(shape, 4096, (0.3,))]
    written = json.loads((tmp_path / "bsp_prefill_qwen2.5-7b_h200.json").read_text())
    assert written["shape"] == rep["shape"] == {"heads": 28, "kv_heads": 4, "dense_kv_heads": 2, "head_dim": 128,
                                                "sink": 128, "local": 256}
    # The default is the Llama-3-8B layer the module's constants used to fix, under the same file name.
    seen.clear()
    bsp_bench.run(str(tmp_path), contexts=(4096,), fractions=(0.3,), skip_parity=True)
    assert json.loads((tmp_path / "bsp_prefill_h200.json").read_text())["shape"] == {
        "heads": 32, "kv_heads": 8, "dense_kv_heads": 4, "head_dim": 128, "sink": 128, "local": 256}
    assert (seen[0][0].heads, seen[0][0].kv_heads, seen[0][0].group) == (32, 8, 4)


def test_bsp_prefill_main_refuses_an_unknown_model(capsys):
    with pytest.raises(SystemExit) as e:
        bsp_bench.main(["out", "--model", "qwen9", "--skip-parity"])
    assert e.value.code == 2 and "unknown preset 'qwen9'" in capsys.readouterr().err


def test_bsp_prefill_variants_flag_names_the_warp_specialized_shapes(monkeypatch, capsys):
    got = {}

    def run(out, contexts, fractions, variants, name=None, skip_parity=False, model=None):
        got["variants"] = variants
        return {"parity": [], "rows": []}

    monkeypatch.setattr(bsp_bench, "run", run)
    bsp_bench.main(["out", "--variants", "ws_s3", "wsi_s3", "wsp_s4", "mma_mt2_w4", "v4_s2", "v4_s3", "v5_s2", "v5_s3",
                    "v5_s4"])
    assert [(v.impl, v.stages, v.rows, v.threads) for v in got["variants"]] == [
        ("ws", 3, 128, 384), ("wsi", 3, 128, 384), ("wsp", 4, 128, 384), ("mma", 3, 128, 128), ("v4", 2, 128, 384),
        ("v4", 3, 128, 384), ("v5", 2, 128, 384), ("v5", 3, 128, 384), ("v5", 4, 128, 384)]
    assert "v5_s3" in [v.name for v in bsp_bench.VARIANTS]  # the GPU test's parity and the default run
    bsp_bench.main(["out", "--variants", "v5_s3", "v5p_s3"])  # v5 beside its persistent grid
    assert [(v.impl, v.persist, v.name) for v in got["variants"]] == [("v5", False, "v5_s3"), ("v5", True, "v5p_s3")]
    for bad in ("ws_s9", "v4_s4", "v5_s5"):
        with pytest.raises(SystemExit) as e:
            bsp_bench.main(["out", "--variants", bad])
        assert e.value.code == 2 and f"unknown variant {bad}" in capsys.readouterr().err


def test_kernels_adaptive_comparison_sums_each_layers_budget(tmp_path, monkeypatch):
    """``--adaptive-budgets resampled --adaptive-only``: per context, the 32 llama3-8b layers' times at
    their own budgets (one timing per distinct budget) against 32 x the uniform 4096's. The timing
    is replaced by a made-up cost per budget; the budgets and the sums are what is checked."""
    asked = []

    def fake_times(mc, ctx, budgets):
        asked.append((ctx, list(budgets), mc.num_kv_heads))
        return {b: {"attention_ms": 0.01 + b * 1e-6, "cycle_ms": 0.02 + b * 2e-6} for b in budgets}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "header", lambda: {"device": "test"})
    monkeypatch.setattr(kernels, "copy_bandwidth_tbps", lambda: 4.0)
    monkeypatch.setattr(kernels, "adaptive_times", fake_times)
    monkeypatch.setattr(kernels, "_decode_row", lambda *a: pytest.fail("decode rows with --adaptive-only"))
    monkeypatch.setattr(kernels, "_prefill_row", lambda *a: pytest.fail("prefill rows with --adaptive-only"))
    assert kernels.main([str(tmp_path), "--adaptive-budgets", "resampled", "--adaptive-only"]) == 0
    rep = json.loads((tmp_path / "kernels_adaptive_h200.json").read_text())
    ad = rep["adaptive"]
    assert ad["resampled"] and ad["resampled_from"] == "lserve/patterns/smollm2-135m/adaptive_budgets.json"
    assert ad["layers"] == 32 and ad["source_layers"] == 30 and ad["mean_budget"] == kernels.BUDGET
    tokens = ad["layer_tokens"]
    assert len(tokens) == 32 and all(t % kernels.PAGE == 0 for t in tokens) and len(set(tokens)) > 4
    assert kernels.BUDGET - kernels.PAGE <= ad["mean_tokens"] <= kernels.BUDGET  # pages rounded down
    # one timing per distinct budget (the uniform one included), at 64k, 128k, 256k
    assert asked == [(c, sorted(set(tokens) | {kernels.BUDGET}), 8) for c in (65536, 131072, 262144)]
    for row in ad["rows"]:
        attn = sum(0.01 + t * 1e-6 for t in tokens)
        assert row["adaptive_attention_ms"] == pytest.approx(attn)
        assert row["uniform_attention_ms"] == pytest.approx(32 * (0.01 + kernels.BUDGET * 1e-6))
        assert row["adaptive_over_uniform_attention"] == round(attn / row["uniform_attention_ms"], 4)
    assert rep["decode"] == [] and rep["prefill"] == []
    text = kernels.summary_table(rep)
    assert "adaptive / uniform 4096 (target <= 1.05)" in text and "resampled from lserve/patterns" in text


def test_kernels_adaptive_refusals(tmp_path, capsys):
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps({"kind": "adaptive-budgets", "ratios": [1.0] * 30}))
    assert kernels.main([str(tmp_path), "--adaptive-budgets", str(bad), "--adaptive-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"lserve: error: adaptive budgets {bad} are for 30 layers but the model has 32"]
    with pytest.raises(SystemExit) as e:
        kernels.main([str(tmp_path), "--adaptive-only"])
    assert e.value.code == 2 and "--adaptive-only needs --adaptive-budgets" in capsys.readouterr().err
