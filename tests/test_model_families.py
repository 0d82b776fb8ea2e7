"""Llama, Mistral, Qwen2 and Qwen3 checkpoints (tiny, random, saved by transformers as sharded
safetensors) load through ``--model DIR`` and match transformers: logits to 1e-4 (float32), dense
and with a page budget covering the context; greedy text through ``lserve generate`` identical.
Forward-changing config fields we do not implement are refused with one clear error."""

from __future__ import annotations

import pytest
import torch
from hf_dirs import make_hf_dir

from lserve.cli import main as lserve_main
from lserve.config import ConfigError, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.models.loader import load_model

#: family -> (transformers config class, its kwargs). GQA groups 2, 5, 7 and 4; head_dim 16.
FAMILIES = {
    "llama-bias-gelu": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                            mlp_bias=True, hidden_act="gelu")),
    "mistral": ("MistralConfig", dict(num_attention_heads=10, num_key_value_heads=2, head_dim=16,
                                      sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=7, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)),
    "qwen2-yarn": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                                       rope_parameters={"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                                        "original_max_position_embeddings": 32})),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16)),
}
TOL = dict(rtol=1e-4, atol=1e-4)  # float32 on both sides; the differences are summation order


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, smol):
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, (cls_name, kw) in FAMILIES.items():
        out[name] = (root / name, make_hf_dir(root / name, smol.tokenizer, cls_name, **kw))
    return out


def _ids(tok, n: int) -> list[int]:
    return tok.encode("The grass is green and the sky is blue. " * 40)[:n]


def _last_logits(eng: LLMEngine, ids: list[int]) -> torch.Tensor:
    seen = []
    fwd = eng.model.forward
    eng.model.forward = lambda *a, **k: seen.append(fwd(*a, **k)) or seen[-1]
    eng.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    return seen[-1][0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_logits_match_transformers_dense_and_full_budget(family_dirs, smol, family):
    path, hf = family_dirs[family]
    assert len(list(path.glob("*.safetensors"))) > 1  # really sharded
    ids = _ids(smol.tokenizer, 150)
    with torch.inference_mode():
        res = hf(torch.tensor([ids]), use_cache=True)
    ref = res.logits[0, -1].float()
    loaded = load_model(str(path))
    assert loaded.config.architecture == family.split("-")[0]
    dense = LLMEngine(EngineConfig(model=str(path), sparsity=SparsityConfig(token_budget=0), max_batched_tokens=64),
                      loaded)
    keys = {}  # layer -> [T, Hkv, D]: what the backend writes to the cache and its page statistics
    run = dense.backend.run
    dense.backend.run = lambda i, q, k, v, plan: keys.setdefault(i, []).append(k.clone()) or run(i, q, k, v, plan)
    torch.testing.assert_close(_last_logits(dense, ids), ref, **TOL)
    for i, layer in enumerate(res.past_key_values.layers):  # transformers caches post-norm, post-RoPE keys
        torch.testing.assert_close(torch.cat(keys[i])[: len(ids)].transpose(0, 1), layer.keys[0], **TOL)
    # Sparse decode (selector on every layer from the first step) with a budget covering the context.
    sparse = LLMEngine(EngineConfig(model=str(path), sparsity=SparsityConfig(
        token_budget=512, dynamic_threshold=0, select_layers="all", reuse_interval=1)), loaded)
    out = sparse.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    with torch.inference_mode():
        ref_ids = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              pad_token_id=2)[0, len(ids):].tolist()
    assert out.token_ids == ref_ids


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_lserve_generate_cli_equals_transformers_generate(family_dirs, smol, family, capsys):
    path, hf = family_dirs[family]
    prompt = "Once upon a time, in a land far away, there lived"
    ids = smol.tokenizer.encode(prompt)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          pad_token_id=2)[0, len(ids):].tolist()
    assert lserve_main(["generate", prompt, "--model", str(path), "--max-tokens", "12", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    if 2 in ref:  # EOS ends our generation: compare up to it
        ref = ref[: ref.index(2)]
    assert printed.rstrip("\n") == smol.tokenizer.decode(ref)


REFUSED = {
    "mistral window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=16),
                       "sliding-window attention"),
    "qwen2 window": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                         sliding_window=16, max_window_layers=0), "sliding-window attention"),
    "relu": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, hidden_act="relu"), "hidden_act 'relu'"),
    "longrope": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                     rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                      "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                                      "original_max_position_embeddings": 64}), "rope scaling"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unimplemented_forward_fields_are_refused(tmp_path, smol, case, capsys):
    cls_name, kw, words = REFUSED[case]
    make_hf_dir(tmp_path, smol.tokenizer, cls_name, **kw)
    capsys.readouterr()
    with pytest.raises(ConfigError, match=words):
        load_model(str(tmp_path))
    assert lserve_main(["generate", "hi", "--model", str(tmp_path), "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lserve: error: ") and "not supported" in err[0]


def test_qwen2_without_sliding_window_flag_loads_and_unknown_architecture_is_refused(tmp_path, smol):
    import json

    make_hf_dir(tmp_path, smol.tokenizer, "Qwen2Config", num_attention_heads=4, num_key_value_heads=2,
                use_sliding_window=False, sliding_window=16)
    assert load_model(str(tmp_path)).config.qkv_bias
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("preset", ["qwen2.5-7b", "qwen3-8b", "mistral-7b"])
def test_family_presets_have_the_real_shapes_and_transformers_runs_their_weights(preset):
    """The presets' shapes; their random weights (shrunk to 2 layers of width 64) load strictly
    into transformers' model of the family (the e2e benchmark's baseline) and give our logits."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from lserve.models.hf_config import hf_config
    from lserve.models.presets import preset_config, random_weights

    cfg = preset_config(preset)
    shapes = {"qwen2.5-7b": (28, 28, 4, 128, 3584, 18944, 152064), "qwen3-8b": (36, 32, 8, 128, 4096, 12288, 151936),
              "mistral-7b": (32, 32, 8, 128, 4096, 14336, 32768)}[preset]
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size,
            cfg.vocab_size) == shapes
    assert (cfg.qkv_bias, cfg.qk_norm) == (preset == "qwen2.5-7b", preset == "qwen3-8b")
    small = replace(cfg, num_layers=2, hidden_size=64, intermediate_size=96, head_dim=16, vocab_size=300,
                    num_heads=cfg.group_size, num_kv_heads=1)
    w = random_weights(small, torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_config(hf_config(small, attn_implementation="sdpa")).eval()
    hf.load_state_dict(w, strict=True)
    ids = list(range(3, 80))
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    from lserve.models.loader import LoadedModel
    from lserve.models.tokenizer import PresetTokenizer

    eng = LLMEngine(EngineConfig(model=preset, sparsity=SparsityConfig(token_budget=0)),
                    LoadedModel(small, w, PresetTokenizer(small.vocab_size), "test"))
    torch.testing.assert_close(_last_logits(eng, ids), ref.float(), **TOL)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_classify_heads_and_calibrate_selection_run_on_the_family(family_dirs, family, tmp_path):
    """The gate trainer (whose forward reuses the model's q/k/v projection, norms and MLP) and the
    selection calibration run on a tiny checkpoint of the family; the pattern loads into an engine."""
    from lserve.calibration.classifier import GateTrainConfig, train_gates
    from lserve.calibration.selection import CalibrationConfig, calibrate_selection

    path, _ = family_dirs[family]
    loaded = load_model(str(path))
    cfg = GateTrainConfig(model=str(path), out=str(tmp_path / "gates"), steps=1, sink_tokens=16, local_tokens=32,
                          min_context=160, max_context=192, num_passkeys=1)
    p = train_gates(cfg, loaded, progress=False)
    assert p.alphas.shape == (loaded.config.num_layers, loaded.config.num_kv_heads)
    eng = LLMEngine(EngineConfig(model=str(path), sparsity=SparsityConfig(pattern=str(tmp_path / "gates"),
                                                                          static_sparsity=0.5)), loaded)
    assert eng.describe()["sparsity"]["pattern"] == str(tmp_path / "gates")
    cal = calibrate_selection(CalibrationConfig(model=str(path), out=str(tmp_path / "cal.json"), tasks=("passkey",),
                                                contexts=(300,), depths=(0.5,), budget="64", min_budget=0,
                                                threshold=0.5), progress=False)
    assert cal["num_layers"] == 2 and cal["model_identity"]["architecture"] == family
