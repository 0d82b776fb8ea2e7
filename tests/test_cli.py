"""The ``lserve`` command: streamed generation and one-line errors with a non-zero exit."""

from __future__ import annotations

import subprocess
import sys

import pytest


def lserve(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lserve", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_streams_default_model(smol):  # smol: the weight cache is warm
    r = lserve("generate", "The capital of France is", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "6 generated tokens" in r.stderr


def test_generate_with_sparsity_flags_on_preset():
    r = lserve("generate", "hello", "--model", "tiny", "--max-tokens", "4", "--pattern", "random",
               "--page-size", "16", "--sink", "16", "--local", "32", "--token-budget", "32", "--kv-quant", "int4")
    assert r.returncode == 0, r.stderr


def test_generate_with_adaptive_budgets_file(tmp_path):
    import json

    from lserve.sparsity.adaptive_budget import ADAPTIVE_KIND

    p = tmp_path / "ratios.json"
    p.write_text(json.dumps({"kind": ADAPTIVE_KIND, "ratios": [0.5, 1.0, 2.0, 4.0]}))  # the tiny preset's 4 layers
    r = lserve("generate", "hello " * 40, "--model", "tiny", "--max-tokens", "4", "--pattern", "random",
               "--page-size", "16", "--sink", "16", "--local", "32", "--token-budget", "32",
               "--dynamic-threshold", "0", "--select-layers", "all", "--adaptive-budgets", str(p))
    assert r.returncode == 0, r.stderr
    r = lserve("generate", "hi", "--model", "tiny", "--adaptive-budgets", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model.gguf"], "model '/no/such/model.gguf' not found"),
    (["--static-sparsity", "1.5"], "static_sparsity must be in [0, 1]"),
    (["--page-size", "48", "--logical-page-size", "32"], "must be a multiple of logical_page_size"),
    (["--sink", "100"], "multiples of the page size"),
    (["--pattern", "/no/such/pattern"], "head pattern not found"),
    (["--backend", "cupy"], "needs a CUDA device"),
    (["--max-tokens", "0"], "max_tokens must be"),
    (["--adaptive-budgets", "auto"], "no shipped adaptive budgets"),
    (["--itl-slo-ms", "-5"], "itl_slo_ms must be in [0, 60000]"),
    (["--min-prefill-share", "1"], "min_prefill_share must be in (0, 1)"),
])
def test_bad_settings_print_one_line(args, message):
    r = lserve("generate", "hi", "--model", "tiny", *args) if "--model" not in args else lserve("generate", "hi", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lserve: error:") and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_engine_flag_defaults_have_one_source():
    """The CLI flags and the serve settings take their engine defaults from one table (the
    config dataclasses' fields, with the command line's defaults declared beside them)."""
    import argparse
    from dataclasses import fields

    from lserve.cli import add_engine_args
    from lserve.config import CacheConfig, EngineConfig, SparsityConfig, engine_flag_defaults
    from lserve.serve.settings import ENGINE_FIELDS, ServeSettings

    table = engine_flag_defaults()
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert vars(p.parse_args([])) == table
    serve = {f.name: f.default for f in fields(ServeSettings) if f.name in ENGINE_FIELDS}
    assert set(serve) == set(table)
    assert {k: v for k, v in serve.items() if v != table[k]} == {"device": "auto"}
    assert table["sink"] == SparsityConfig().sink_tokens and table["max_cache_tokens"] == CacheConfig().dense_pool_tokens
    # where the command line departs from the library: declared on the field (cli_default)
    library = {"pattern": SparsityConfig().pattern, "max_batched_tokens": EngineConfig().max_batched_tokens,
               "step_time_target": EngineConfig().step_time_target, "itl_slo_ms": EngineConfig().itl_slo_ms}
    assert library == {"pattern": None, "max_batched_tokens": 2048, "step_time_target": 0.0, "itl_slo_ms": 0.0}
    assert {k: table[k] for k in library} == {"pattern": "auto", "max_batched_tokens": 8192, "step_time_target": 0.25,
                                              "itl_slo_ms": 100.0}


def test_every_engine_flag_sets_its_config_field():
    """Each engine flag, given a value of its own, lands on the field that declares it (and only there)."""
    from lserve.cli import build_parser
    from lserve.config import CacheConfig, EngineConfig, SparsityConfig, engine_config_from_args, engine_flags

    given = {"model": "tiny", "device": "cpu", "dtype": "float16", "backend": "torch", "max_model_len": 123,
             "allow_long_max_model_len": True, "max_num_seqs": 3, "max_batched_tokens": 99, "step_time_target": 0.5,
             "itl_slo_ms": 7.0, "min_prefill_share": 0.2, "seed": 5, "cuda_graphs": False, "fused_ops": False,
             "async_decode": False, "prefix_cache": False, "pattern": "random", "static_sparsity": 0.25, "sink": 32,
             "local": 48, "token_budget": 64, "reuse_interval": 2, "dynamic_threshold": 9, "dense_layers": 1,
             "select_mode": "query", "select_layers": "none", "adaptive_budgets": "", "prefill_sparsity": 0.5,
             "prefill_sparsity_min_len": 11, "prefill_block": 32, "prefill_q_block": 96, "prefill_estimator": "bound",
             "page_size": 16, "logical_page_size": 8, "max_cache_tokens": 1000, "kv_quant": "int8",
             "host_kv_gib": 0.5}
    assert set(given) == {f.name for f in engine_flags()}
    argv = ["generate", "hi"]
    for name, value in given.items():
        flag = "--" + name.replace("_", "-")
        argv += ([flag] if value else ["--no-" + flag[2:]]) if isinstance(value, bool) else [flag, str(value)]
    cfg = engine_config_from_args(build_parser().parse_args(argv))
    owners = {EngineConfig: cfg, SparsityConfig: cfg.sparsity, CacheConfig: cfg.cache}
    assert {f.name: getattr(owners[f.owner], f.field_name) for f in engine_flags()} == given
    assert (cfg.sparsity.sink_tokens, cfg.sparsity.local_tokens, cfg.cache.dense_pool_tokens) == (32, 48, 1000)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_model_folder_without_tokenizer_is_one_line(tmp_path, command):
    import json

    import torch
    from safetensors.torch import save_file

    cfg = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"model.embed_tokens.weight": torch.zeros(300, 64)}, str(tmp_path / "model.safetensors"))
    r = lserve(command, "--model", str(tmp_path), "--device", "cpu")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("lserve: error: no tokenizer in") and "tokenizer.json" in lines[0], r.stderr


def test_serve_help_shows_defaults():
    r = lserve("serve", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "--host HOST address to listen on" in text and "(default: 127.0.0.1)" in text
    assert "--port PORT HTTP port" in text and "(default: 8000)" in text
    assert "(default: 30.0)" in text and "(default: 10.0)" in text  # --shutdown-grace-s, --sse-keepalive-s
