"""GGUF files of Llama, Mistral, Qwen2 and Qwen3 (tiny, random, written as llama.cpp writes them,
with the bundled model's tokenizer) load through ``--model FILE.gguf``: our logits equal
transformers' on the same file to 1e-4 (float32), ``lserve generate`` gives transformers' greedy
tokens, and no shipped calibration is taken for them. Where transformers misreads a file's
metadata we read it right (checked against the model the file was written from); what we do
not implement is refused with one error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFValueType
from gguf_files import write_gguf
from hf_dirs import random_hf_model
from logits_capture import capture_logits

from lserve.cli import main as lserve_main
from lserve.config import ConfigError, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.models.loader import load_model

VOCAB = 49152  # the bundled SmolLM2 tokenizer the files carry
#: family -> (transformers config class, its kwargs, llama.cpp architecture, general.name, our architecture,
#: transformers' class for the file). GQA groups 2, 4, 5, 4; theta other than the default everywhere.
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=5e5,
                                  tie_word_embeddings=True), "llama", "Tiny Llama", "llama", "LlamaForCausalLM"),
    # llama.cpp converts a Mistral to its "llama" architecture; head_dim 16 != 64/8, as in Mistral NeMo
    "mistral": ("MistralConfig", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, sliding_window=None,
                                      rope_theta=1e6), "llama", "Tiny Mistral 7B Instruct", "llama",
                "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=5, num_key_value_heads=1, hidden_size=80, rope_theta=1e6,
                                  tie_word_embeddings=True), "qwen2", "Tiny Qwen2.5", "qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128, rope_theta=1e6),
              "qwen3", "Tiny Qwen3", "qwen3", "Qwen3ForCausalLM"),
}
TOL = dict(rtol=1e-4, atol=1e-4)  # float32 on both sides; the differences are summation order
PROMPT = "Once upon a time, in a land far away, there lived"


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    """Dequantized copies go to a temporary cache, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


def _write(folder, family: str, cls_name: str, kw: dict, arch: str, name: str, **extra):
    model = random_hf_model(VOCAB, cls_name, **kw)
    return write_gguf(folder / f"{family}.gguf", model, arch, name, kw.get("rope_theta", 1e4), **extra), model


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {f: _write(root, f, cls, kw, arch, name)[0] for f, (cls, kw, arch, name, _, _) in FAMILIES.items()}


def _logits(eng: LLMEngine, ids: list[int]) -> torch.Tensor:
    seen = capture_logits(eng)
    eng.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    return seen[-1][0]


def _ids(tok) -> list[int]:
    return tok.encode("The grass is green and the sky is blue. " * 12)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_family_matches_transformers_on_the_same_file(gguf_files, smol, family, capsys):
    from transformers import AutoModelForCausalLM

    *_, ours, hf_class = FAMILIES[family]
    path = gguf_files[family]
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                              attn_implementation="sdpa").eval()
    assert type(hf).__name__ == hf_class
    loaded = load_model(str(path))
    cfg = loaded.config
    hf_head_dim = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    assert (cfg.architecture, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == (
        ours, hf.config.num_attention_heads, hf.config.num_key_value_heads, hf_head_dim,
        FAMILIES[family][1]["rope_theta"])
    assert (cfg.qkv_bias, cfg.qk_norm) == (family == "qwen2", family == "qwen3")
    ids = _ids(smol.tokenizer)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    eng = LLMEngine(EngineConfig(model=str(path), sparsity=SparsityConfig(token_budget=0)), loaded)
    torch.testing.assert_close(_logits(eng, ids), ref, **TOL)

    # `lserve generate` (greedy) prints transformers' greedy continuation of the same file.
    prompt_ids = smol.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        ref_ids = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              pad_token_id=2)[0, len(prompt_ids):].tolist()
    capsys.readouterr()
    assert lserve_main(["generate", PROMPT, "--model", str(path), "--max-tokens", "8", "--temperature", "0"]) == 0
    if 2 in ref_ids:  # EOS ends our generation: compare up to it
        ref_ids = ref_ids[: ref_ids.index(2)]
    assert capsys.readouterr().out.rstrip("\n") == smol.tokenizer.decode(ref_ids)

    # Random weights are not the shipped model: `auto` finds nothing and says so.
    auto = LLMEngine(EngineConfig(model=str(path), sparsity=SparsityConfig(
        pattern="auto", select_layers="auto")), loaded)
    facts = auto.describe()
    assert facts["streaming_fraction"] == 0.0 and facts["sparsity"]["shipped"] is None
    assert facts["sparsity"]["summary"].startswith("pattern none (auto: none ships for this model) (0 of KV heads")


#: Files transformers misreads (it takes Qwen's head size from the class default or hidden/heads,
#: and cannot load a llama file whose general.name is "mistral"): we check them against the
#: model they were written from. GQA group 7 with head_dim 16 != 64/7; Qwen3 head_dim 16, not 128.
MISREAD = {
    "qwen2-group7": ("Qwen2Config", dict(num_attention_heads=7, num_key_value_heads=1, head_dim=16, rope_theta=1e6),
                     "qwen2", "Tiny Qwen2.5"),
    "qwen3-head16": ("Qwen3Config", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, rope_theta=1e6),
                     "qwen3", "Tiny Qwen3"),
    "named-mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=None,
                                            rope_theta=1e6), "llama", "mistral"),
}


@pytest.mark.parametrize("case", list(MISREAD))
def test_gguf_metadata_transformers_misreads_is_read_right(tmp_path, smol, case):
    path, model = _write(tmp_path, case, *MISREAD[case])
    loaded = load_model(str(path))
    assert loaded.config.head_dim == model.config.head_dim
    ids = _ids(smol.tokenizer)
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0, -1]
    eng = LLMEngine(EngineConfig(model=str(path), sparsity=SparsityConfig(token_budget=0)), loaded)
    torch.testing.assert_close(_logits(eng, ids), ref, **TOL)


def test_gguf_yarn_rope_scaling_is_carried(tmp_path, smol):
    """llama.cpp's rope scaling keys (which transformers' GGUF reader drops) become our yarn scaling."""
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "rope_theta": 1e4}
    model = random_hf_model(VOCAB, "Qwen2Config", num_attention_heads=4, num_key_value_heads=2, rope_parameters=yarn,
                            max_position_embeddings=256)
    path = write_gguf(tmp_path / "yarn.gguf", model, "qwen2", "Tiny Qwen2.5 1M", 1e4, extra={
        "rope.scaling.type": ("yarn", GGUFValueType.STRING), "rope.scaling.factor": (8.0, GGUFValueType.FLOAT32),
        "rope.scaling.original_context_length": (32, GGUFValueType.UINT32)})
    loaded = load_model(str(path))
    assert loaded.config.rope_scaling == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}
    ids = _ids(smol.tokenizer)[:100]  # past the original 32 positions
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0, -1]
    eng = LLMEngine(EngineConfig(model=str(path), sparsity=SparsityConfig(token_budget=0)), loaded)
    torch.testing.assert_close(_logits(eng, ids), ref, **TOL)


def test_gguf_llama3_rope_as_per_frequency_factors(tmp_path, smol):
    """A Llama 3.1+ GGUF keeps its llama3 rope scaling as llama.cpp's ``rope_freqs`` tensor (each
    frequency's divisor), which transformers' reader drops: we apply it, and match the model with
    the llama3 scaling it was written from past the original context."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32, "rope_theta": 5e5}
    model = random_hf_model(VOCAB, "LlamaConfig", num_attention_heads=4, num_key_value_heads=2,
                            rope_parameters=llama3, max_position_embeddings=256)
    d = model.config.hidden_size // 4
    plain = 1.0 / (5e5 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    factors = (plain / model.model.rotary_emb.inv_freq.float()).numpy().astype(np.float32)
    assert factors.max() > 1.5  # the scaling changes some frequencies
    path = write_gguf(tmp_path / "llama31.gguf", model, "llama", "Tiny Llama 3.1", 5e5,
                      extra_tensors={"rope_freqs.weight": factors})
    loaded = load_model(str(path))
    assert loaded.config.rope_scaling["rope_type"] == "freq_factors"
    ids = _ids(smol.tokenizer)[:100]  # past the original 32 positions
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0, -1]
    eng = LLMEngine(EngineConfig(model=str(path), sparsity=SparsityConfig(token_budget=0)), loaded)
    torch.testing.assert_close(_logits(eng, ids), ref, **TOL)


#: case -> (llama.cpp architecture, extra metadata, extra tensors, words of the error)
REFUSED = {
    "mistral3 architecture": ("mistral3", {}, {}, "architecture 'mistral3' is not supported: LServe reads GGUF "
                              r"files of llama \(Llama, Mistral\), qwen2 \(Qwen2, Qwen2.5\), qwen3 \(Qwen3\)"),
    "sliding window": ("llama", {"attention.sliding_window": (16, GGUFValueType.UINT32)}, {},
                       "sliding-window attention"),
    "rope_freqs beside a scaling": ("llama", {"rope.scaling.type": ("linear", GGUFValueType.STRING),
                                              "rope.scaling.factor": (2.0, GGUFValueType.FLOAT32)},
                                    {"rope_freqs.weight": np.ones(8, np.float32)}, "per-frequency rope factors"),
    "partial rotary": ("llama", {"rope.dimension_count": (8, GGUFValueType.UINT32)}, {}, "rotary embeddings on 8"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_gguf_we_cannot_run_is_refused_with_one_error(tmp_path, case, capsys):
    arch, extra, tensors, words = REFUSED[case]
    model = random_hf_model(VOCAB, "MistralConfig", num_attention_heads=4, num_key_value_heads=2,
                            sliding_window=None)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, arch, "Tiny Mistral", 1e4, extra=extra, extra_tensors=tensors)
    with pytest.raises(ConfigError, match=words):
        load_model(str(path))
    capsys.readouterr()
    assert lserve_main(["generate", "hi", "--model", str(path), "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lserve: error: ") and "not supported" in err[0]
