"""Shipped calibrations are found by what the model is (family, shapes, weight fingerprint), not
by its file name; where ``auto`` finds none the engine says so and runs without streaming heads."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from lserve.config import ConfigError, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.models.loader import default_model_path, load_model

AUTO = SparsityConfig(pattern="auto", select_layers="auto", adaptive_budgets="auto", token_budget=256,
                      dynamic_threshold=0)


def test_renamed_default_gguf_gets_the_same_describe_and_output(tmp_path, monkeypatch, smol):
    monkeypatch.setenv("LSERVE_CACHE_DIR", str(tmp_path / "cache"))  # the copy converts once, here
    renamed = tmp_path / "smol.gguf"
    shutil.copyfile(default_model_path(), renamed)
    other = load_model(str(renamed))
    assert other.config.name == "smol" and other.config.fingerprint == smol.config.fingerprint
    ids = smol.tokenizer.encode("The grass is green. " * 60)[:600]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    a = LLMEngine(EngineConfig(model="default", sparsity=AUTO), smol)
    b = LLMEngine(EngineConfig(model=str(renamed), sparsity=AUTO), other)
    assert a.describe() == b.describe()
    facts = b.describe()["sparsity"]
    assert facts["pattern"] == facts["select_layers"] == facts["adaptive_budgets"] == "shipped:smollm2-135m"
    assert b.describe()["streaming_fraction"] == pytest.approx(0.5, abs=0.02)
    assert a.generate([ids], params)[0].token_ids == b.generate([ids], params)[0].token_ids


def test_auto_without_a_shipped_calibration_says_so(caplog):
    tiny = load_model("tiny")
    with caplog.at_level(logging.INFO, logger="lserve"):
        eng = LLMEngine(EngineConfig(model="tiny", sparsity=SparsityConfig(pattern="auto")), tiny)
    assert eng.describe()["streaming_fraction"] == 0.0
    facts = eng.describe()["sparsity"]
    assert facts["shipped"] is None
    assert facts["pattern"] == "none (auto: none ships for this model)"
    assert facts["select_layers"] == "all (auto: none ships for this model)"
    assert any("no shipped head pattern for model 'tiny'" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="no shipped adaptive budgets for model 'tiny'"):
        LLMEngine(EngineConfig(model="tiny", sparsity=SparsityConfig(adaptive_budgets="auto")), tiny)


def test_same_shapes_other_weights_are_not_the_shipped_model(smol):
    """The default model's shapes and name with other weights: the shipped pattern is not used."""
    w = dict(smol.weights)
    w["model.norm.weight"] = w["model.norm.weight"] * 1.5
    from lserve.identity import fingerprint

    assert fingerprint(w) != smol.config.fingerprint
    assert fingerprint({k: v.to(torch.bfloat16) for k, v in smol.weights.items()}) == smol.config.fingerprint
