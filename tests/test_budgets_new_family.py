"""``lserve calibrate-budgets`` on a family other than Llama: ``lserve bench selection-mass`` on a
tiny random Qwen3 checkpoint (q/k RMSNorm, 3 layers, sharded safetensors), then the calibration
from its report; the written ratios have one entry per layer of the model and load into an engine."""

from __future__ import annotations

import json

from hf_dirs import make_hf_dir

from lserve.cli import main as lserve_main


def test_selection_mass_then_calibrate_budgets_on_qwen3(tmp_path, smol, capsys):
    model = tmp_path / "qwen3"
    make_hf_dir(model, smol.tokenizer, "Qwen3Config", num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=3)
    assert lserve_main(["bench", "selection-mass", "--model", str(model), "--contexts", "512", "--decode-tokens", "2",
                        "--depths", "0.5", "--budgets", "128", "256", "--out", str(tmp_path), "--name", "mass"]) == 0
    report = json.loads((tmp_path / "mass.json").read_text())
    assert report["model_identity"]["architecture"] == "qwen3" and report["model_identity"]["num_layers"] == 3
    assert report["dense_heads"] == [[0, 1]] * 3  # no pattern ships for it: every head dense
    assert report["observations"]["512"] == [2 * 2] * 3  # 2 prompts x 2 decode steps, every layer

    out = tmp_path / "budgets.json"
    assert lserve_main(["calibrate-budgets", "--mass", str(tmp_path / "mass.json"), "--context", "512",
                        "--mean-budget", "192", "--out", str(out)]) == 0
    cal = json.loads(out.read_text())
    assert len(cal["ratios"]) == len(cal["budgets"]) == len(cal["mass"]) == 3
    assert all(r is not None and r > 0 for r in cal["ratios"]) and cal["mean"] <= 192
    assert cal["model_identity"]["architecture"] == "qwen3"
    # Without --out it would go beside the model's shipped pattern: none ships, so one clear error.
    capsys.readouterr()
    assert lserve_main(["calibrate-budgets", "--mass", str(tmp_path / "mass.json"), "--context", "512"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lserve: error: no shipped pattern folder for model")
    # The ratios drive an engine of that model (their length is checked against its layers).
    assert lserve_main(["generate", "hi", "--model", str(model), "--max-tokens", "2", "--token-budget", "128",
                        "--adaptive-budgets", str(out)]) == 0
