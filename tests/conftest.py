"""Shared fixtures: the default model is loaded once per test session."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# Hermetic thresholds: engines with dynamic_threshold "auto" see the shipped profiles only, never
# one that `lserve bench profile-threshold` left on this machine (subprocesses inherit this).
os.environ.setdefault("LSERVE_THRESHOLD_FILE", os.path.join(tempfile.gettempdir(), "lserve-tests-no-profile.json"))


@pytest.fixture(scope="session")
def smol():
    """The bundled SmolLM2-135M-Instruct (dequantized float32 weights, tokenizer)."""
    from lserve.models.loader import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def hf_smol(smol):
    """transformers' own Llama with the same weights, config read from the GGUF by transformers."""
    from transformers import AutoConfig, LlamaForCausalLM

    from lserve.models.loader import default_model_path

    p = default_model_path()
    cfg = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(smol.weights, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    return model.eval()


@pytest.fixture
def seeded():
    torch.manual_seed(0)
