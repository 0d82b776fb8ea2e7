"""A ``max_model_len`` past the model's context is refused unless its rope scaling reaches it or the
user accepts it (``--allow-long-max-model-len``): on the command line and in the serve settings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lserve.config import ConfigError, ModelConfig
from lserve.serve.settings import ServeSettings

SMOL_CONTEXT = 8192  # SmolLM2-135M's trained context


def lserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lserve", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_refuses_a_length_past_the_trained_context(command, smol):  # smol: the weight cache is warm
    r = lserve(command, "--device", "cpu", "--max-model-len", "1000000")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lserve: error:"), r.stderr
    assert "1000000" in lines[0] and str(SMOL_CONTEXT) in lines[0] and "--allow-long-max-model-len" in lines[0]


def test_cli_accepts_the_trained_context_and_an_explicit_override(smol):
    r = lserve("generate", "hi", "--max-tokens", "1", "--max-model-len", str(SMOL_CONTEXT))
    assert r.returncode == 0, r.stderr
    r = lserve("generate", "hi", "--max-tokens", "1", "--max-model-len", "9001", "--allow-long-max-model-len")
    assert r.returncode == 0, r.stderr


def _hf_config_dir(tmp_path, rope: dict | None, tokenizer):
    """A Hugging Face folder with its config.json and a tokenizer (the check reads nothing else)."""
    tokenizer.save(tmp_path)
    params = {"rope_theta": 10000.0, **(rope or {"rope_type": "default"})}
    cfg = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 64, "rope_parameters": params, "rope_scaling": params,
           "bos_token_id": 1, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("rope, limit", [
    (None, 64),
    ({"rope_type": "linear", "factor": 2.0}, 128),
    ({"rope_type": "dynamic", "factor": 4.0}, 256),
])
def test_serve_settings_allow_what_the_rope_scaling_reaches(tmp_path, rope, limit, smol):
    model = _hf_config_dir(tmp_path, rope, smol.tokenizer)
    ServeSettings(model=model, device="cpu", max_model_len=limit).check_model_available()
    with pytest.raises(ConfigError, match=f"max_model_len {limit + 1} is longer than the {limit} tokens"):
        ServeSettings(model=model, device="cpu", max_model_len=limit + 1).check_model_available()
    ServeSettings(model=model, device="cpu", max_model_len=limit + 1,
                  allow_long_max_model_len=True).check_model_available()


def test_serve_run_builder_refuses_it_too(smol):
    from lserve.serve.app import build_app

    with pytest.raises(ConfigError, match=f"max_model_len 1000000 is longer than the {SMOL_CONTEXT} tokens"):
        build_app({"device": "cpu", "max_model_len": 1000000})


def test_llama3_scaling_is_counted_in_the_trained_length():
    """Hugging Face's Llama 3.1 configs give the scaled length as max_position_embeddings."""
    cfg = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                      max_position_embeddings=131072,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192})
    assert cfg.context_limit == 131072
