"""Dynamic-selection threshold: profiled per device and model shape, picked up by engines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lserve.calibration.threshold_sweep import choose_ratio
from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.sparsity import threshold as th
from lserve.sparsity.plan import SeqStep


def test_choose_ratio_needs_every_larger_context_to_pay():
    rows = [{"context": 1000, "dense_ms": 1.0, "dynamic_ms": 0.9},  # a fluke: 2000 does not pay
            {"context": 2000, "dense_ms": 1.0, "dynamic_ms": 1.1},
            {"context": 4000, "dense_ms": 2.0, "dynamic_ms": 1.5},
            {"context": 8000, "dense_ms": 4.0, "dynamic_ms": 1.6}]
    assert choose_ratio(rows, 1000) == (4.0, 4000)
    never = [dict(r, dynamic_ms=r["dense_ms"] * 2) for r in rows]
    assert choose_ratio(never, 1000) == (16.0, None)  # twice the largest measured ratio


def test_user_profile_overrides_shipped(tmp_path, monkeypatch):
    shipped, user = tmp_path / "dynamic_threshold.json", tmp_path / "user.json"
    shipped.write_text(json.dumps({"k1": {"ratio": 3.0}, "k2": {"ratio": 5.0}}))
    monkeypatch.setattr(th, "PROFILES", tmp_path)
    monkeypatch.setenv("LSERVE_THRESHOLD_FILE", str(user))
    assert th.lookup_ratio("k1") == (3.0, str(shipped))
    th.save_profile("k1", {"ratio": 1.5})
    th.save_profile("k3", {"ratio": 2.0})  # merged, not overwritten
    assert th.lookup_ratio("k1") == (1.5, str(user))
    assert th.lookup_ratio("k2") == (5.0, str(shipped))
    assert th.lookup_ratio("k3") == (2.0, str(user))
    assert th.lookup_ratio("nope") is None


def _engine(threshold: int = -1) -> LLMEngine:
    sp = SparsityConfig(token_budget=128, dynamic_threshold=threshold)
    return LLMEngine(EngineConfig(model="tiny", sparsity=sp, cache=CacheConfig(dense_pool_tokens=2048), max_model_len=2048))


def _dynamic_at(engine: LLMEngine, length: int) -> bool:
    pages = list(range(-(-length // 64)))
    plan = engine.backend.plan([SeqStep(99, length - 1, 1, True, pages, [])])
    engine.backend.release(99)
    return plan.seqs[0].dynamic


def test_engine_auto_threshold_from_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("LSERVE_THRESHOLD_FILE", str(tmp_path / "p.json"))
    eng = _engine()
    assert eng.threshold_source is None and _dynamic_at(eng, 200)  # unprofiled: selection past the budget
    key = th.profile_key("cpu", eng.model_config, torch.float32)
    th.save_profile(key, {"ratio": 3.0})
    eng = _engine()
    assert eng.backend.planner.threshold_ratio == 3.0 and eng.threshold_source == str(tmp_path / "p.json")
    assert not _dynamic_at(eng, 383) and _dynamic_at(eng, 384)  # from 3 x 128 tokens
    # a per-request budget scales the threshold: 3 x 256
    plan = eng.backend.plan([SeqStep(7, 700, 1, True, list(range(12)), [], token_budget=256)])
    assert not plan.seqs[0].dynamic
    plan = eng.backend.plan([SeqStep(8, 767, 1, True, list(range(12)), [], token_budget=256)])
    assert plan.seqs[0].dynamic
    assert _dynamic_at(_engine(threshold=0), 200)  # an explicit threshold wins over the profile


def test_profile_threshold_command_writes_what_engines_read(tmp_path, monkeypatch):
    prof, out = tmp_path / "prof.json", tmp_path / "out"
    cmd = [sys.executable, "-m", "lserve", "bench", "profile-threshold", "--model", "tiny", "--device", "cpu",
           "--budget", "128", "--contexts", "192", "512", "--decode-tokens", "4", "--out", str(out),
           "--profile-file", str(prof), "--name", "t"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "t.json").read_text())
    assert [row["context"] for row in report["rows"]] == [192, 512] and (out / "t.png").stat().st_size > 0
    assert all(row["dense_ms"] > 0 and row["dynamic_ms"] > 0 for row in report["rows"])
    monkeypatch.setenv("LSERVE_THRESHOLD_FILE", str(prof))
    eng = _engine()
    assert eng.backend.planner.threshold_ratio == pytest.approx(report["ratio"])
    bad = subprocess.run(cmd[:-2] + ["--budget", "10"], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "--budget must be at least" in bad.stderr and "Traceback" not in bad.stderr
