"""The host tier's capacity arithmetic (llama3-8b sizes against the H200 run) and the concurrency
mode on the CPU with the tiny preset: sequences held all-GPU and with the tier, decoding together."""

from __future__ import annotations

import json

import pytest
import torch

from lserve.bench.e2e import CONFIGS
from lserve.bench.host_tier import main, parse_args
from lserve.bench.host_tier_common import admits, make_engine, setup
from lserve.bench.host_tier_concurrency import plan
from lserve.bench.host_tier_sizes import kv_sizes, max_context, seqs_all_gpu, seqs_tier, tier_split
from lserve.models.presets import preset_config

GPU, HOST = 124586688512.0, 107220487372.8  # benchmarks/host_tier/host_tier_h200.json


@pytest.fixture(scope="module")
def llama_int4():
    return kv_sizes("llama3-8b", preset_config("llama3-8b"), CONFIGS["lserve"], "int4", torch.bfloat16)


@pytest.fixture(scope="module")
def llama_bf16():
    return kv_sizes("llama3-8b", preset_config("llama3-8b"), CONFIGS["lserve"], "none", torch.bfloat16)


def test_llama3_8b_bytes_per_token(llama_int4, llama_bf16):
    # the H200 JSON's kv_bytes_per_token; the host keeps K, V and scales, the device also 4 KiB of key stats
    assert llama_int4.device_per_token == 22528 and llama_int4.host_per_token == 18432
    assert llama_bf16.device_per_token == 69632 and llama_bf16.host_per_token == 65536
    assert llama_int4.stats_per_token == llama_bf16.stats_per_token == 4096


def test_longest_context_of_the_h200_with_its_host(llama_int4):
    mx = max_context(llama_int4, GPU, HOST, 8192)
    assert mx["gpu"] == pytest.approx(5530304, abs=1000)  # the JSON's max_context_gpu
    assert 10_000_000 < mx["tier"] < 10_400_000  # the whole device and the host's 80%: just past 10M


def test_sequences_at_128k_bf16_all_gpu_and_with_the_tier(llama_bf16):
    tokens = 131072 + 600
    assert seqs_all_gpu(llama_bf16, GPU, tokens) == 13
    # the device's host RAM gives ~1.9x, not the 3x (39) that needs ~240 GB of host memory
    assert seqs_tier(llama_bf16, GPU, 100 * 2**30, tokens, 8192) == 25
    assert seqs_tier(llama_bf16, GPU, 230e9, tokens, 8192) == 38
    assert seqs_tier(llama_bf16, GPU, 240e9, tokens, 8192) == 39


ARGS = ["--concurrency", "--model", "tiny", "--device", "cpu", "--contexts", "768", "--kv-quant", "none",
        "--gpu-kv-gib", "0.005", "--host-kv-gib", "0.01", "--max-batched-tokens", "256", "--decode-steps", "3"]


def test_the_engines_admit_what_the_arithmetic_plans_and_no_more(tmp_path):
    from lserve.engine import SamplingParams

    s, _ = parse_args([str(tmp_path), *ARGS])
    st = setup(s)
    gpu, tier = plan(st, 768)
    assert gpu["n_seqs"] >= 1 and tier["n_seqs"] > gpu["n_seqs"]
    for r in (gpu, tier):
        eng = make_engine(st, r["pool_tokens"], r["host_kv_gib"], r["n_seqs"], r["seq_tokens"] + 64)
        assert admits(eng, r["seq_tokens"]) == r["n_seqs"]
        assert (eng.cache.host_tier is not None) == (r["mode"] == "tier")
    split = tier_split(st.sizes, st.gpu_bytes, st.host_bytes, tier["n_seqs"], 256)
    assert eng.cache.dense_alloc.num_pages == split["virtual_pages"]  # the tier's engine, as the arithmetic says
    assert eng.cache.nbytes()["dense"] + eng.cache.nbytes()["streaming"] <= st.gpu_bytes
    # a sequence more than the all-GPU engine admits never gets its first token while the others hold theirs
    eng = make_engine(st, gpu["pool_tokens"], 0.0, gpu["n_seqs"], gpu["seq_tokens"] + 64)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=gpu["seq_tokens"] - 768, temperature=0, ignore_eos=True)
    rids = [eng.add_request(torch.randint(0, 500, (768,), generator=g).tolist(), params)
            for _ in range(gpu["n_seqs"] + 1)]
    first, done = set(), False
    for _ in range(400):  # until one of the admitted ones finishes (and frees its pages)
        outs = eng.step()
        first |= {o.request_id for o in outs if o.token_ids}
        if any(o.finished for o in outs):
            done = True
            break
    assert done and first == set(rids[:-1])


def test_concurrency_cli_holds_more_sequences_with_the_tier(tmp_path, capsys):
    assert main([str(tmp_path), *ARGS]) == 0
    report = json.loads((tmp_path / "host_tier_concurrency.json").read_text())
    gpu, tier = report["rows"]
    assert (gpu["mode"], tier["mode"]) == ("gpu", "tier") and report["kv_quant"] == "none"
    for r in (gpu, tier):
        assert r["held_all"] and r["freed"] and r["n_seqs"] == r["n_seqs_planned"] and r["output_tok_s"] > 0
        # one token a sequence a timed step: the warm-up steps' tokens are not counted
        assert r["output_tok_s"] * r["decode_ms_per_step"] / 1e3 == pytest.approx(r["n_seqs"])
    assert tier["n_seqs"] > gpu["n_seqs"] and tier["h2d_bytes_per_decode_step"] > 0
    assert tier["staged_parts_per_decode_step"] == 0  # the torch backend has no staging area
    assert report["ratios"]["768"]["seqs"] == tier["n_seqs"] / gpu["n_seqs"]
    assert f"{tier['n_seqs']}/{tier['n_seqs']} decoding" in capsys.readouterr().out


def test_capacity_builds_each_engine_at_its_longest_context(tmp_path):
    """--capacity: the tier's engine holds and admits a request longer than the all-GPU one can."""
    args = ["--capacity", "--model", "tiny", "--device", "cpu", "--kv-quant", "none", "--gpu-kv-gib", "0.005",
            "--host-kv-gib", "0.01", "--max-batched-tokens", "256"]
    assert main([str(tmp_path), *args]) == 0
    rep = json.loads((tmp_path / "host_tier_capacity.json").read_text())
    rows = {r["mode"]: r for r in rep["rows"]}
    assert rows["tier"]["tokens"] > 2 * rows["gpu"]["tokens"] > 0
    for r in rows.values():
        assert r["held_sequences"] == 1 and r["refused"] is None, r
    assert rep["command"] and rep["date"] and rep["device"]
    # the check is real: the all-GPU engine refuses the tier's length
    from lserve.engine import SamplingParams
    from lserve.engine.request_check import RequestError

    s, _ = parse_args([str(tmp_path), *args])
    st = setup(s)
    g = rows["gpu"]
    eng = make_engine(st, g["pool_tokens"], 0.0, 1, rows["tier"]["tokens"] + 64)
    with pytest.raises(RequestError):
        eng.check_request([1] * rows["tier"]["tokens"], SamplingParams(max_tokens=8))
    with pytest.raises(SystemExit):
        parse_args([str(tmp_path), *args, "--concurrency"])


def test_capacity_retries_smaller_after_running_out_of_device_memory(tmp_path, monkeypatch):
    """A build that runs out of memory is recorded and retried with less of the device, not raised."""
    import lserve.bench.host_tier_capacity as cap

    real, calls = cap.make_engine, []

    def flaky(st, pool, host_gib, n, max_len):
        calls.append(pool)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 338.00 MiB")
        assert st.loaded is None  # capacity engines load their own weights, as a replica does
        return real(st, pool, host_gib, n, max_len)

    monkeypatch.setattr(cap, "make_engine", flaky)
    args = ["--capacity", "--model", "tiny", "--device", "cpu", "--kv-quant", "none", "--gpu-kv-gib", "0.005",
            "--host-kv-gib", "0.01", "--max-batched-tokens", "256"]
    assert main([str(tmp_path), *args]) == 0
    rows = {r["mode"]: r for r in json.loads((tmp_path / "host_tier_capacity.json").read_text())["rows"]}
    assert rows["gpu"]["attempts"] == 2 and rows["tier"]["attempts"] == 1
    assert calls[1] < calls[0]  # the retry sized a smaller pool
    assert rows["gpu"]["held_sequences"] == 1 and "error" not in rows["gpu"]


def test_overhead_parts_name_the_lserve_lines_that_allocated_most():
    from lserve.bench.host_tier_common import top_allocations

    def blk(size, state, *files):
        return {"size": size, "state": state,
                "frames": [{"filename": f, "line": 7, "name": "fn"} for f in files]}

    snap = {"segments": [{"blocks": [
        blk(300, "active_allocated", "/x/torch/nn/functional.py", "/w/lserve/models/llama.py"),
        blk(200, "active_allocated", "/w/lserve/models/llama.py"),
        blk(900, "inactive", "/w/lserve/engine/cuda_graphs.py"),  # freed: not the engine's
        blk(100, "active_allocated", "/x/torch/cuda/graphs.py"),
        blk(50, "active_allocated", "/w/lserve/cache/kv_cache.py"),
    ]}]}
    assert top_allocations(snap) == {"models/llama.py:7 fn": 500, "other": 100, "cache/kv_cache.py:7 fn": 50}
    assert list(top_allocations(snap, top=1)) == ["models/llama.py:7 fn"]


def test_concurrency_profiles_the_host_after_the_timed_steps(tmp_path, capsys):
    """``--host-profile-steps``: after the timed steps, more steps of all sequences under cProfile
    (host ms a step by function), within each sequence's token slack (all still held, freed after)."""
    assert main([str(tmp_path), *ARGS, "--host-profile-steps", "3"]) == 0
    rows = json.loads((tmp_path / "host_tier_concurrency.json").read_text())["rows"]
    for r in rows:
        assert r["held_all"] and r["freed"] and r["host_profiled_steps"] == 3
        assert any(k.endswith(":step") for k in list(r["host_cumtime_ms_per_step"])[:3])
    assert "cProfile 3 steps" in capsys.readouterr().out
