"""Decode steps replayed as CUDA graphs give the tokens of the same engine run eagerly.

Tiny preset in float32 (graph and eager runs differ only in how decode work is split, i.e. in
float32 summation order), 50% streaming heads, dynamic selection with reuse (the select and
reuse steps are different graphs), a batch of mixed lengths whose page tables cross buckets
while decoding, requests finishing at different times (the batch shrinks: new keys).
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams
from lserve.models.fused import FusedOps
from lserve.models.loader import load_model


def _engine(loaded, graphs: bool, kv_quant: str = "none", dtype: str = "float32", fused: bool = False,
            adaptive: str = "", backend: str = "cupy") -> LLMEngine:
    cfg = EngineConfig(model="tiny", device="cuda", backend=backend, dtype=dtype, cuda_graphs=graphs, fused_ops=fused,
                       sparsity=SparsityConfig(pattern="random", static_sparsity=0.5, sink_tokens=32,
                                               local_tokens=64, token_budget=64, reuse_interval=4,
                                               dynamic_threshold=0, adaptive_budgets=adaptive,
                                               select_layers="all" if adaptive else "auto"),
                       cache=CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=16384, kv_quant=kv_quant),
                       max_num_seqs=4, max_batched_tokens=2048)
    return LLMEngine(cfg, loaded=loaded)


def _run(engine: LLMEngine, prompts, max_tokens):
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    outs = engine.generate(prompts, params)
    assert engine.cache.all_free()
    st = engine.backend.selector_stats
    return [o.token_ids for o in outs], (st.runs, st.reuses, st.pages)


@pytest.mark.parametrize("kv_quant", ["none", "int8"])
def test_graph_decode_matches_eager(kv_quant, seed):
    loaded = load_model("tiny", dtype=torch.float32, device="cuda", seed=seed % 1000)
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (300, 517, 45, 1029)]
    max_tokens = [90, 60, 120, 75]
    ref, ref_stats = _run(_engine(loaded, False, kv_quant), prompts, max_tokens)
    eng = _engine(loaded, True, kv_quant)
    got, got_stats = _run(eng, prompts, max_tokens)
    g = eng.graphs
    assert g.disabled is None and g.captures >= 2 and g.replays > 0.5 * eng.steps, (g.disabled, g.captures, g.replays)
    assert got == ref
    assert got_stats == ref_stats  # replays count the selector runs and reuses they perform


def test_adaptive_budgets_graphs_eager_and_torch_agree(seed, tmp_path):
    """Per-layer budgets (layer 3 reads everything once its budget covers the context): graph
    replays and eager cupy steps give the same tokens and selector counts, and the tokens of
    the torch oracle (fp32; fewer tokens than above, where near-ties between backends are rare)."""
    import json

    from lserve.sparsity.adaptive_budget import ADAPTIVE_KIND

    p = tmp_path / "ratios.json"
    p.write_text(json.dumps({"kind": ADAPTIVE_KIND, "ratios": [0.5, 1.0, 2.0, 20.0]}))
    loaded = load_model("tiny", dtype=torch.float32, device="cuda", seed=seed % 1000)
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (300, 517, 45, 1029)]
    max_tokens = [40, 30, 45, 35]
    ref, _ = _run(_engine(loaded, False, adaptive=str(p), backend="torch"), prompts, max_tokens)
    eager, eager_stats = _run(_engine(loaded, False, adaptive=str(p)), prompts, max_tokens)
    eng = _engine(loaded, True, adaptive=str(p))
    got, got_stats = _run(eng, prompts, max_tokens)
    assert eng.graphs.disabled is None and eng.graphs.replays > 0.5 * eng.steps
    assert eager == ref and got == ref
    assert got_stats == eager_stats and eager_stats[0] > 0 and eager_stats[1] > 0
    assert eng.stats().kv_read.read < eng.stats().kv_read.dense  # the meter follows the layers' budgets


def _staggered(engine: LLMEngine, prompts, max_tokens, arrive_at):
    """Requests arriving at given steps (so later prompts prefill while earlier ones decode)."""
    rids, done, step = {}, {}, 0
    while len(done) < len(prompts):
        for i, at in enumerate(arrive_at):
            if at == step:
                rids[engine.add_request(prompts[i], SamplingParams(max_tokens=max_tokens[i], temperature=0,
                                                                   ignore_eos=True))] = i
        for out in engine.step():
            if out.finished:
                done[rids[out.request_id]] = out.token_ids
        step += 1
    return [done[i] for i in range(len(prompts))]


def test_steps_that_decode_and_prefill_split_into_replay_and_eager_prefill(seed):
    loaded = load_model("tiny", dtype=torch.float32, device="cuda", seed=seed % 1000)
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (200, 333, 900, 1500)]
    max_tokens, arrive_at = [80, 70, 40, 30], [0, 1, 14, 30]
    runs = []
    for graphs in (False, True):
        eng = _engine(loaded, graphs)
        eng.scheduler.budget.max_batched_tokens = 256  # the long prompts prefill in chunks next to the decodes
        runs.append(_staggered(eng, prompts, max_tokens, arrive_at))
    ref, got = runs
    assert eng.step_kinds["mixed_graph"] >= 4, eng.step_kinds  # decodes replayed, chunks eager, same step
    assert got == ref


def test_graph_decode_step_syncs_only_to_read_tokens(seed):
    loaded = load_model("tiny", dtype=torch.bfloat16, device="cuda", seed=seed % 1000)
    eng = _engine(loaded, True, dtype="bfloat16")
    rng = random.Random(seed)
    eng.add_request([rng.randrange(256) for _ in range(700)], SamplingParams(max_tokens=200, temperature=0,
                                                                               ignore_eos=True))
    for _ in range(12):  # prefill, eager first sight of each key, capture, replays
        eng.step()
    torch.cuda.synchronize()
    per_step = []  # (replayed, sync warnings) per step
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(8):
            before = eng.graphs.replays
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                eng.step()
            syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
            per_step.append((eng.graphs.replays > before, syncs))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    replayed = [syncs for ok, syncs in per_step if ok]
    assert len(replayed) >= 6, per_step  # a bucket edge in the window costs an eager step or two
    assert all(len(syncs) <= 1 for syncs in replayed), replayed  # reading the sampled token back


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim, hidden, inter", [(64, 576, 1536), (128, 4096, 14336),  # SmolLM2, Llama-3-8B
                                                     (64, 500, 1002), (128, 9216, 3000)])  # widths without 16B paths
@pytest.mark.parametrize("vector", [True, False])
def test_fused_ops_match_torch(dtype, head_dim, hidden, inter, vector):
    ops = FusedOps(dtype, head_dim)
    ops.vector = vector
    assert ops.self_check(hidden, inter, 40, head_dim, 1e-5, torch.device("cuda")) is None


def test_fused_engine_matches_torch_elementwise(seed):
    loaded = load_model("tiny", dtype=torch.float32, device="cuda", seed=seed % 1000)
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (300, 517, 45)]
    eng = _engine(loaded, True, fused=True)
    assert eng.model.fused is not None and eng.fused_problem is None
    got, _ = _run(eng, prompts, [40, 40, 40])
    ref, _ = _run(_engine(loaded, True, fused=False), prompts, [40, 40, 40])
    assert got == ref


def test_mixed_graph_steps_time_their_prefill_part(seed):
    """A step that replays the decodes' graph and prefills eagerly times its prefill part with
    CUDA events, for the step budget's rate of prefill next to decodes."""
    loaded = load_model("tiny", dtype=torch.bfloat16, device="cuda", seed=seed % 1000)
    cfg = EngineConfig(model="tiny", device="cuda", backend="cupy", dtype="bfloat16", step_time_target=0.05,
                       itl_slo_ms=40.0, cache=CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=32768),
                       max_num_seqs=4, max_batched_tokens=2048)
    eng = LLMEngine(cfg, loaded=loaded)
    rng = random.Random(seed)
    eng.add_request([rng.randrange(256) for _ in range(200)], SamplingParams(max_tokens=400, temperature=0,
                                                                          ignore_eos=True))
    for _ in range(40):  # decoding, with its graph captured
        eng.step()
    eng.add_request([rng.randrange(256) for _ in range(12000)], SamplingParams(max_tokens=2, temperature=0,
                                                                            ignore_eos=True))
    timed = []
    while eng.has_unfinished() and len(timed) < 5:
        eng.step()
        info = eng.last_step_info
        if info["graph"] and info["prefill_tokens"]:
            timed.append((info["prefill_seconds"], info["seconds"]))
    assert timed and all(p is not None and 0 < p <= s for p, s in timed), timed
    assert eng.scheduler.budget.mixed_rate is not None
