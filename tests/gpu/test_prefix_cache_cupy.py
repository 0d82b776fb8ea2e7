"""Prefix cache on the cupy backend: greedy outputs with the cache equal those without it.

Tiny preset, random 50% streaming pattern (sink 32, local 64), 16-token pages, a 64-token
budget (page selection from 5 pages on), a 600-token shared document asked three questions one
after the other, so the second and third resume after ~37 cached pages: dense heads read shared
pages (K/V, key statistics, INT8 scales), streaming heads a ring filled from the shadow pages.

* float32: the cupy backend prefills through the torch reference (its fast prefill needs a
  16-bit dtype) and decodes with its kernels; tokens must be identical.
* bf16: the prefill of a resumed chunk goes through ``CupyBackend.prefill_cont``. The uncached
  run is made to end a chunk where the cached one resumed (bf16 outputs depend on chunk ends);
  the pages before it were still computed in chunks of other lengths (matmuls over different row
  counts round differently), so, as in test_engine_cupy.py, the first token must match and the
  prefill logits agree closely, and the tokens must be identical (CUDA graphs on, as served).
"""

from __future__ import annotations

import pytest
import torch
from chunk_ends import chunks_end_at

from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams
from lserve.models.loader import load_model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_cuda():
    return load_model("tiny", dtype=torch.float32, device="cuda", seed=0)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    doc = torch.randint(3, 250, (600,), generator=g).tolist()
    return [doc + torch.randint(3, 250, (n,), generator=g).tolist() for n in (21, 9, 40)]


def _engine(loaded, prefix_cache: bool, dtype: str, kv_quant: str = "none", graphs: bool = False) -> LLMEngine:
    cfg = EngineConfig(model="tiny", device="cuda", backend="cupy", dtype=dtype, prefix_cache=prefix_cache,
                       sparsity=SparsityConfig(pattern="random", static_sparsity=0.5, sink_tokens=32, local_tokens=64,
                                               token_budget=64, reuse_interval=4, dynamic_threshold=0),
                       cache=CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=8192, kv_quant=kv_quant),
                       max_num_seqs=4, max_batched_tokens=1024, cuda_graphs=graphs, fused_ops=graphs)
    return LLMEngine(cfg, loaded=loaded)


def _first_logits(engine: LLMEngine) -> list[torch.Tensor]:
    """Record the logits of each request's prefill (the forward that samples its first token)."""
    seen: list[torch.Tensor] = []
    fwd = engine.model.forward

    def wrapped(*a, **k):
        out = fwd(*a, **k)  # [rows that sample, V]
        prefill = any(not s.in_decode for s in engine.scheduler.running)
        if prefill and out.shape[0]:  # a chunk that ends a prompt (one request at a time here)
            seen.append(out[-1].float().cpu())
        return out

    engine.model.forward = wrapped
    return seen


def _run(engine: LLMEngine, prompts):
    return [engine.generate([p], GREEDY)[0] for p in prompts]


@pytest.mark.parametrize("kv_quant", ["none", "int8"])
def test_float32_tokens_identical_with_and_without_cache(tiny_cuda, kv_quant):
    prompts = _prompts()
    cached_engine = _engine(tiny_cuda, True, "float32", kv_quant)
    cached = _run(cached_engine, prompts)
    hits = [o.metrics["cached_tokens"] for o in cached]
    assert hits[0] == 0 and all(h >= 592 for h in hits[1:]), hits
    plain_engine = _engine(tiny_cuda, False, "float32", kv_quant)
    plain = _run(plain_engine, prompts[:1])
    if kv_quant != "none":  # quantized K/V: a follow-up's outputs depend on where its chunks end
        chunks_end_at(plain_engine, sorted(set(hits[1:])))
    plain += _run(plain_engine, prompts[1:])
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert cached_engine.cache.all_free() and cached_engine.stats().prefix_cache_hits == sum(hits)


def test_bf16_resumed_prefill_through_prefill_cont_matches_uncached(tiny_cuda):
    loaded = load_model("tiny", dtype=torch.bfloat16, device="cuda", seed=0)
    prompts = _prompts()
    cached_engine = _engine(loaded, True, "bfloat16", graphs=True)
    cached_logits = _first_logits(cached_engine)
    cached = _run(cached_engine, prompts)
    hits = [o.metrics["cached_tokens"] for o in cached]
    assert hits[0] == 0 and all(h >= 592 for h in hits[1:]), hits
    plain_engine = _engine(loaded, False, "bfloat16", graphs=True)
    plain_logits = _first_logits(plain_engine)
    plain = _run(plain_engine, prompts[:1])
    chunks_end_at(plain_engine, sorted(set(hits[1:])))
    plain += _run(plain_engine, prompts[1:])
    assert len(cached_logits) == len(plain_logits) == 3
    for a, b in zip(cached_logits, plain_logits):
        assert (a - b).abs().max() <= 0.05 * b.abs().max(), (a - b).abs().max()
    assert [o.token_ids[0] for o in cached] == [o.token_ids[0] for o in plain]
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
