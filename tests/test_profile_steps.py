"""``scripts/profile_steps.py`` on the CPU (tiny model): a batch of sequences decoding together is
profiled, and its JSON holds the per-op time, the step's wall time and the host gap between them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_profile_a_decode_batch_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_steps.py"), str(tmp_path), "--model", "tiny",
                        "--context", "64", "--batch", "2", "--steps", "2", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((tmp_path / "profile_lserve_64_b2.json").read_text())
    assert rep["context"] == 64 and rep["prefill"] and rep["prefill_gpu_ms"] > 0
    [b] = rep["batches"]
    assert b["batch"] == 2 and b["kernels"] == rep["decode"]
    assert b["kernel_ms"] == round(sum(k["us_per_step"] for k in b["kernels"]) / 1e3, 4) > 0
    assert b["step_ms"] > 0 and b["eager_step_ms"] > 0
    assert abs(b["host_gap_ms"] - (b["step_ms"] - b["kernel_ms"])) < 1e-2
    assert any(k["kernel"] == "aten::mm" for k in b["kernels"])  # the projections of the decode step
    assert "decode, batch 2: kernels" in r.stdout


def test_profile_refuses_a_batch_of_zero(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_steps.py"), str(tmp_path), "--batch", "0"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "--batch and --steps must be >= 1" in r.stderr
