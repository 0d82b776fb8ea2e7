"""Per-layer block-sparse prefill thresholds: ``lserve calibrate-prefill`` and ``--prefill-sparsity auto``."""

import json
import logging

import pytest
import torch

from lserve.calibration.prefill import choose_taus
from lserve.cli import main
from lserve.config import PREFILL_MIN_LEN_UNPROFILED, CacheConfig, ConfigError, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.models.loader import load_model
from lserve.sparsity.prefill_taus import CALIBRATION_KIND, TAU_GRID, default_calibration_for, load_layer_taus


def test_choose_taus_takes_the_smallest_tau_that_holds_on_every_prompt():
    grid = (0.5, 0.9, 1.0)
    curves = torch.tensor([[[0.90, 0.80], [0.96, 0.90], [1.0, 1.0]],     # prompt 1: [tau, head]
                           [[0.97, 0.99], [0.94, 0.99], [1.0, 1.0]]])   # prompt 2
    # head 0 reaches 0.95 on both prompts only at tau 1.0 (0.94 at 0.9 on prompt 2); head 1 at 1.0 too
    assert choose_taus(curves, 0.95, grid) == [1.0, 1.0]
    assert choose_taus(curves, 0.9, grid) == [0.5, 0.9]  # head 0: 0.90 and 0.97 at tau 0.5
    assert choose_taus(curves, 0.8, grid) == [0.5, 0.5]


def test_calibrate_prefill_cli_writes_taus_the_engine_refuses_for_another_model(tmp_path, capsys):
    out = tmp_path / "taus.json"
    rc = main(["calibrate-prefill", "--model", "tiny", "--contexts", "4500", "--tasks", "passkey", "--pattern",
               "none", "--target-mass", "0.9", "--out", str(out), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    tiny = load_model("tiny").config
    assert data["kind"] == CALIBRATION_KIND and data["num_layers"] == tiny.num_layers
    assert len(data["layer_taus"]) == tiny.num_layers and all(t in TAU_GRID for t in data["layer_taus"])
    assert [max(h) for h in data["head_taus"]] == data["layer_taus"]  # every head dense (--pattern none)
    # the chosen tau holds the target on the worst prompt, the grid step below it does not
    for layer, taus in enumerate(data["head_taus"]):
        for h, t in enumerate(taus):
            i = TAU_GRID.index(t)
            assert data["worst_mass"][layer][i][h] >= 0.9
            assert i == 0 or data["worst_mass"][layer][i - 1][h] < 0.9
    assert "wrote" in capsys.readouterr().out
    assert load_layer_taus(out, tiny.num_layers, tiny.num_kv_heads) == tuple(data["layer_taus"])
    with pytest.raises(ConfigError, match=f"is for {tiny.num_layers} layers"):
        load_layer_taus(out, tiny.num_layers + 1, tiny.num_kv_heads)


def test_cli_prefill_sparsity_takes_auto_or_a_tau(capsys):
    assert main(["generate", "hi", "--model", "tiny", "--max-tokens", "1", "--prefill-sparsity", "auto"]) == 0
    capsys.readouterr()
    assert main(["generate", "hi", "--model", "tiny", "--prefill-sparsity", "1.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lserve: error: prefill_sparsity must be in [0, 1]")
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--model", "tiny", "--prefill-sparsity", "most"])
    assert e.value.code == 2 and "must be a number in [0, 1] or 'auto', got 'most'" in capsys.readouterr().err
    # a serve config (YAML / JSON) says it the same way
    from lserve.serve.settings import ServeSettings

    assert ServeSettings.from_dict({"prefill_sparsity": "auto"}).prefill_sparsity == -1.0
    with pytest.raises(ConfigError, match="or 'auto', got 'most'"):
        ServeSettings.from_dict({"prefill_sparsity": "most"})


def test_auto_without_a_calibration_is_off_and_says_so(caplog):
    loaded = load_model("tiny")
    with caplog.at_level(logging.INFO):
        eng = LLMEngine(EngineConfig(model="tiny", sparsity=SparsityConfig(pattern=None, token_budget=0,
                                                                           prefill_sparsity=-1.0)), loaded)
    assert eng.backend.prefill_layer_taus is None and eng.sparsity.prefill_sparsity == 0.0
    assert "block-sparse prefill: off (no prefill calibration ships" in caplog.text


def test_auto_uses_the_shipped_per_layer_taus():
    """The default model's shipped calibration gives each layer its own tau: the engine keeps the
    layers' tiles by their own thresholds (fewer kept tiles than every layer at the largest tau)."""
    loaded = load_model("default")
    mc = loaded.config
    path = default_calibration_for(mc)
    assert path is not None and path.name == "prefill_taus.json"  # found by the model's identity
    shipped = json.loads(path.read_text())
    assert load_layer_taus(path, mc.num_layers, mc.num_kv_heads) == tuple(shipped["layer_taus"])
    prompt = list(range(100, 100 + 1100))
    sp = SparsityConfig(pattern="auto", token_budget=0, prefill_sparsity=-1.0, prefill_sparsity_min_len=256,
                        prefill_q_block=256)
    eng = LLMEngine(EngineConfig(model="default", sparsity=sp, cache=CacheConfig(dense_pool_tokens=1280),
                                 max_batched_tokens=1280, prefix_cache=False), loaded)
    assert eng.backend.prefill_layer_taus == tuple(shipped["layer_taus"])

    def kept(tau):  # tiles kept by one prefill (tau None: the engine's per-layer taus)
        before = list(eng.backend.prefill_tiles)
        eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prefill_sparsity=tau))
        return [a - b for a, b in zip(eng.backend.prefill_tiles, before)]

    auto_kept, causal = kept(None)
    assert 0 < auto_kept < causal
    top = max(t for t in shipped["layer_taus"] if t < 1.0)
    top_kept, _ = kept(top)  # one request: every layer at the largest calibrated tau
    if min(shipped["layer_taus"]) < top:
        assert auto_kept < top_kept


def test_default_model_prefill_sparsity_follows_the_device_profile(smol, tmp_path, monkeypatch, caplog):
    """On by default where both are measured: the default model ships its taus, so an engine left
    at the defaults prefills sparse from the profiled length of this device and shape, and stays
    dense (chunks off the row grid too) where no profile says it pays."""
    import lserve.sparsity.threshold as threshold
    from lserve.sparsity.threshold import profile_key

    profile = tmp_path / "prefill_threshold.json"
    monkeypatch.setenv("LSERVE_PREFILL_THRESHOLD_FILE", str(profile))
    monkeypatch.setattr(threshold, "PROFILES", tmp_path / "none")  # no shipped profile either
    cfg = EngineConfig(model="default", sparsity=SparsityConfig(prefill_q_block=256),  # rows short enough to skip
                       cache=CacheConfig(dense_pool_tokens=4096), max_batched_tokens=1024)
    with caplog.at_level(logging.INFO):
        off = LLMEngine(cfg, smol)
    assert off.sparsity.prefill_sparsity == 0.0 and off.backend.prefill_layer_taus is None
    # a request's own tau starts where an unprofiled set tau would
    assert off.sparsity.prefill_sparsity_min_len == PREFILL_MIN_LEN_UNPROFILED
    assert "block-sparse prefill: off (no profile of this device" in caplog.text
    assert off.sparsity_in_effect["prefill_sparsity"] == "off"
    key = profile_key("cpu", smol.config, torch.float32)
    profile.write_text(json.dumps({key: {"min_len": 1500, "tau": "auto"}}))
    on = LLMEngine(cfg, smol)
    assert on.sparsity.prefill_sparsity == -1.0 and on.sparsity.prefill_sparsity_min_len == 1500
    assert on.backend.prefill_layer_taus is not None and on.prefill_threshold_source == str(profile)
    assert on.sparsity_in_effect["prefill_sparsity"] == "shipped:smollm2-135m from 1500 tokens"
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for prompt_len, sparse in ((1200, False), (2000, True)):
        before = list(on.backend.prefill_tiles)
        on.generate([list(range(100, 100 + prompt_len))], params)
        kept, causal = (a - b for a, b in zip(on.backend.prefill_tiles, before))
        assert (causal > 0) == sparse and (kept < causal) == sparse, (prompt_len, kept, causal)
