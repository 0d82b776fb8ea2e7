"""Model loading (HF directory, presets, GGUF cache) and RoPE variants against transformers."""

from __future__ import annotations

import pytest
import torch

from lserve.config import ConfigError, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.models.loader import load_model
from lserve.models.presets import PRESETS, preset_config
from lserve.sparsity.patterns import HeadPattern

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


def _tiny_hf_dir(tmp_path, smol, rope):
    from transformers import LlamaConfig, LlamaForCausalLM

    params = {"rope_theta": 10000.0, **(rope or {"rope_type": "default"})}
    cfg = LlamaConfig(vocab_size=smol.config.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rope_parameters=params, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg).eval()
    for p in model.parameters():  # HF init is near-zero: use larger weights so RoPE matters
        torch.nn.init.normal_(p, std=0.2)
    model.save_pretrained(tmp_path)
    smol.tokenizer.save(tmp_path)
    return model


@pytest.mark.parametrize("rope", list(ROPES))
def test_hf_directory_and_rope_variants_match_transformers(tmp_path, smol, rope):
    hf = _tiny_hf_dir(tmp_path, smol, ROPES[rope])
    ids = smol.tokenizer.encode("The grass is green. " * 30)[:100]  # beyond max_position_embeddings=64
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    eng = LLMEngine(EngineConfig(model=str(tmp_path), max_model_len=256, sparsity=SparsityConfig(token_budget=0)))
    assert eng.model_config.rope_scaling == (ROPES[rope] and {**ROPES[rope]})
    seen = []
    fwd = eng.model.forward
    eng.model.forward = lambda *a, **k: seen.append(fwd(*a, **k)) or seen[-1]
    eng.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    torch.testing.assert_close(seen[0][0], ref.float(), rtol=1e-4, atol=1e-4)


def test_presets_have_the_real_shapes():
    l3 = preset_config("llama3-8b")
    assert (l3.num_layers, l3.num_heads, l3.num_kv_heads, l3.head_dim, l3.intermediate_size) == (32, 32, 8, 128, 14336)
    l2 = preset_config("llama2-7b")
    assert (l2.num_kv_heads, l2.head_dim, l2.vocab_size) == (32, 128, 32000)
    assert preset_config("minitron-4b").hidden_size == 3072
    tiny = load_model("tiny")
    n = sum(t.numel() for t in tiny.weights.values())
    assert set(PRESETS) >= {"llama3-8b", "llama2-7b", "minitron-4b", "tiny"} and n > 1e6
    out = LLMEngine(EngineConfig(model="tiny"), tiny).generate(["hi"], SamplingParams(max_tokens=5, temperature=0))
    assert len(out[0].token_ids) == 5


def test_default_model_is_cached_and_refuses_mismatched_pattern(smol, tmp_path):
    from lserve.models.loader import _gguf_cache_dir, default_model_path

    assert (_gguf_cache_dir(default_model_path()) / "weights.safetensors").is_file()
    assert smol.config.num_layers == 30 and smol.config.num_kv_heads == 3 and smol.tokenizer.has_chat_template
    HeadPattern(torch.rand(4, 3).numpy()).save(tmp_path / "p")
    with pytest.raises(ConfigError, match="shape 4x3 .* model has 30x3"):
        LLMEngine(EngineConfig(sparsity=SparsityConfig(pattern=str(tmp_path / "p"))), smol)
    with pytest.raises(ConfigError, match="not found"):
        load_model(str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize("rope", ["default", "llama3", "yarn"])
def test_rope_cos_sin_equal_transformers_at_positions_up_to_10m(rope):
    """cos/sin are computed per step from the positions (no table over positions): equal to
    transformers' rotary embedding at long positions, yarn's attention factor included."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from lserve.models.hf_config import config_from_hf
    from lserve.models.rope import Rope

    params = {"rope_theta": 500000.0, **(ROPES[rope] or {"rope_type": "default"})} if rope != "yarn" else {
        "rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    hf = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64 if rope == "default" else 256,
                     rope_parameters=params)
    pos = torch.tensor([0, 1, 63, 64, 5000, 123457, 4_194_301, 9_999_999])
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), pos[None])
    cos, sin = Rope(config_from_hf(hf, "tiny-hf"), "cpu").cos_sin(pos)
    half = cos.shape[1]
    torch.testing.assert_close(cos, ref_cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin[0, :, :half], rtol=0, atol=1e-6)
