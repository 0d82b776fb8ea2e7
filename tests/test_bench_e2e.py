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
