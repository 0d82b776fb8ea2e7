"""End to end: the engine with backend="cupy" generates the greedy tokens of backend="torch".

Tiny preset (GQA 4, head_dim 64), random 50% streaming pattern, page 16 with a 64-token budget
(dynamic selection triggers from 5 pages on), reuse interval 4, prefill chunked by the scheduler
(the cached-past path), mixed prefill/decode batches.

* float32: the backends differ by float32 rounding only; the tokens must be identical, with
  dynamic selection and with INT8 KV.
* bf16: both backends compute attention in float32 and round to bf16, so an output element
  differs by one bf16 ulp wherever the float32 values straddle a rounding boundary. Downstream
  discrete choices amplify such ulps: the top-(K-1) of ~20 page scores, INT4/INT8 codes, the
  argmax. With static sparsity only (streaming heads, no page selection) the tokens must be
  identical up to a divergence that is a near-tie under both backends' logits (vLLM's
  check_logprobs_close idea); with dynamic selection the prefill logits must agree closely and
  the first token must match (or be a near-tie).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams
from lserve.models.loader import load_model

MAX_TOKENS = 40


def generate_with_logits(engine: LLMEngine, prompts, params):
    """Greedy outputs plus, per request, the logits row of every sampled token (CPU float32)."""
    rows: dict[int, list[torch.Tensor]] = {}
    batches = []
    schedule, forward = engine.scheduler.schedule, engine.model.forward

    def schedule_spy():
        batch = schedule()
        batches.append(batch)
        return batch

    def forward_spy(*args, **kwargs):
        logits = forward(*args, **kwargs)
        sampled = [it.seq for it in batches[-1] if it.seq.num_computed + it.num_tokens == it.seq.num_tokens]
        for seq, row in zip(sampled, logits.float().cpu()):
            rows.setdefault(seq.seq_id, []).append(row)
        return logits

    engine.scheduler.schedule, engine.model.forward = schedule_spy, forward_spy
    outs = engine.generate(prompts, params)
    ids = sorted(rows)  # sequence ids are assigned in prompt order
    return [o.token_ids for o in outs], [rows[i] for i in ids]


def run_engine(backend: str, loaded, kv_quant: str, select_mode: str, dtype: str, prompts, budget: int = 64):
    cfg = EngineConfig(model="tiny", device="cuda", backend=backend, dtype=dtype,
                       sparsity=SparsityConfig(pattern="random", static_sparsity=0.5, sink_tokens=32,
                                               local_tokens=64, token_budget=budget, reuse_interval=4,
                                               select_mode=select_mode),
                       cache=CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=16384, kv_quant=kv_quant),
                       max_num_seqs=4, max_batched_tokens=256, cuda_graphs=False,  # the spy reads every forward
                       async_decode=False,  # chained steps skip schedule(): the spy pairs forwards with batches
                       fused_ops=False)  # attention kernels against the oracle; fused ops: test_cuda_graphs
    engine = LLMEngine(cfg, loaded=loaded)
    tokens, logits = generate_with_logits(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                          ignore_eos=True))
    assert engine.cache.all_free()
    stats = engine.backend.selector_stats
    if budget:
        assert stats.runs > 0 and stats.reuses > 0, f"{backend}: selection did not run and reuse ({stats})"
    return tokens, logits


def assert_near_tie(i: int, p: int, a: list[int], b: list[int], lt: torch.Tensor, lc: torch.Tensor) -> None:
    """Tokens a[p] (torch) and b[p] (cupy) must be within a small margin under both logits rows.

    The logits come out of a bf16 GEMM, so they are bf16 values: the margin is judged against
    8 bf16 ulps of the largest logit (or 5% of the row's spread, whichever is larger).
    """
    ta, tc = a[p], b[p]
    ulp = 2.0 ** (math.floor(math.log2(lt.abs().max().item())) - 7)
    tol = max(0.05 * lt.std().item(), 8 * ulp)
    assert lt[ta] - lt[tc] < tol and lc[tc] - lc[ta] < tol, (
        f"prompt {i}: tokens diverge at {p} ({ta} vs {tc}) without a near-tie: torch margin "
        f"{(lt[ta] - lt[tc]).item():.4g}, cupy margin {(lc[tc] - lc[ta]).item():.4g}, tol {tol:.3g}")


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in (300, 517, 45, 1029)]


@pytest.mark.parametrize("kv_quant,select_mode", [("none", "kv"), ("int8", "query")])
def test_engine_fp32_tokens_identical(kv_quant, select_mode, seed):
    loaded = load_model("tiny", dtype=torch.float32, device="cuda", seed=seed % 1000)
    prompts = _prompts(seed)
    ref, _ = run_engine("torch", loaded, kv_quant, select_mode, "float32", prompts)
    got, _ = run_engine("cupy", loaded, kv_quant, select_mode, "float32", prompts)
    assert all(len(t) == MAX_TOKENS for t in got)
    assert got == ref


def test_engine_bf16_static_sparsity_tokens_match_up_to_near_ties(seed):
    loaded = load_model("tiny", dtype=torch.bfloat16, device="cuda", seed=seed % 1000)
    prompts = _prompts(seed)
    ref, ref_logits = run_engine("torch", loaded, "none", "kv", "auto", prompts, budget=0)
    got, got_logits = run_engine("cupy", loaded, "none", "kv", "auto", prompts, budget=0)
    same = []
    for i, (a, b) in enumerate(zip(ref, got)):
        assert len(b) == MAX_TOKENS
        p = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        same.append(MAX_TOKENS if p is None else p)
        if p is not None:
            assert_near_tie(i, p, a, b, ref_logits[i][p], got_logits[i][p])
    print(f"identical prefix lengths: {same} of {MAX_TOKENS}")


@pytest.mark.parametrize("select_mode", ["kv", "query"])
def test_engine_bf16_dynamic_prefill_logits_and_first_token(select_mode, seed):
    loaded = load_model("tiny", dtype=torch.bfloat16, device="cuda", seed=seed % 1000)
    prompts = _prompts(seed)
    ref, ref_logits = run_engine("torch", loaded, "none", select_mode, "auto", prompts)
    got, got_logits = run_engine("cupy", loaded, "none", select_mode, "auto", prompts)
    same = []
    for i, (a, b) in enumerate(zip(ref, got)):
        assert len(b) == MAX_TOKENS
        first = ref_logits[i][0]
        err = ((got_logits[i][0] - first).norm() / first.norm()).item()
        assert err < 4e-2, f"prompt {i}: first-token logits differ by {err:.3g}"  # ~10 bf16 ulps (2^-8)
        if a[0] != b[0]:
            assert_near_tie(i, 0, a, b, ref_logits[i][0], got_logits[i][0])
        same.append(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), MAX_TOKENS))
    print(f"identical prefix lengths: {same} of {MAX_TOKENS}")
