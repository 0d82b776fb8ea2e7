"""Block-sparse prefill on the GPU: the gathered fast path (bf16, fused kernels) against the masked
fp32 reference on the same block lists, the estimator in bf16 against fp32, and the cupy engine
with prefill sparsity (fresh prompts and chunks with cached past) against its dense prefill."""

from __future__ import annotations

import random

import pytest
import torch

from lserve.attention.block_sparse_prefill import blocked_prefill, sparse_prefill
from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams
from lserve.models.loader import load_model
from lserve.sparsity.prefill_blocks import prefill_blocks


def _qkv(h, g, start, lq, d, seed, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    L = start + lq
    q = torch.randn(h * g, lq, d, generator=gen, device="cuda")
    k = torch.randn(h, L, d, generator=gen, device="cuda")
    v = torch.randn(h, L, d, generator=gen, device="cuda")
    spike = torch.randn(h, 1, d, generator=gen, device="cuda") * 2  # some structure for the estimator
    k[:, L // 3: L // 3 + 64] += spike
    q += spike.repeat_interleave(g, 0)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("g", [1, 4, 5, 7, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("start,lq,qb", [(0, 3000, 512), (1536, 1111, 512), (700, 2357, 256)])
def test_sparse_prefill_bf16_matches_reference(g, d, start, lq, qb, seed):
    h, B = 2, 64
    q, k, v = _qkv(h, g, start, lq, d, seed)
    blocks = prefill_blocks(q, k, start, B, d ** -0.5, 0.7, "antidiagonal", stride=16, q_block=qb)
    assert blocks.kept_fraction() < 0.95
    out = sparse_prefill(q, k, v, blocks, d ** -0.5)
    ref = blocked_prefill(q.float(), k.float(), v.float(), blocks, d ** -0.5)
    err = (out.float() - ref).norm() / ref.norm()
    assert err < 1e-2, float(err)


@pytest.mark.parametrize("estimator", ["antidiagonal", "bound"])
def test_estimator_bf16_keeps_what_fp32_keeps(estimator, seed):
    h, g, d, B, qb = 4, 4, 128, 64, 1024
    q, k, _ = _qkv(h, g, 0, 8192, d, seed)
    a = prefill_blocks(q, k, 0, B, d ** -0.5, 0.8, estimator, stride=16, q_block=qb)
    b = prefill_blocks(q.float(), k.float(), 0, B, d ** -0.5, 0.8, estimator, stride=16, q_block=qb)
    assert abs(a.kept_fraction() - b.kept_fraction()) < 0.05
    agree = (a.block_mask() == b.block_mask()).float().mean()
    assert agree > 0.9, float(agree)


def _engine(loaded, tau: float, backend: str = "cupy", chunk: int = 4096) -> LLMEngine:
    cfg = EngineConfig(model="tiny", device="cuda", backend=backend, dtype="bfloat16", cuda_graphs=False,
                       sparsity=SparsityConfig(pattern="random", static_sparsity=0.5, sink_tokens=32, local_tokens=64,
                                               token_budget=0, prefill_sparsity=tau, prefill_sparsity_min_len=1024,
                                               prefill_block=64, prefill_q_block=256),
                       cache=CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=16384),
                       max_num_seqs=4, max_batched_tokens=chunk)
    return LLMEngine(cfg, loaded=loaded)


@pytest.mark.parametrize("chunk", [4096, 700])
def test_cupy_engine_prefill_sparsity(chunk, seed):
    """tau = 1 (every causal tile through the sparse path) scores every prompt token as the dense
    prefill does (prompt logprobs within bf16 noise: argmax alone flips on near-ties of random
    weights); tau 0.8 skips tiles and still generates, fresh prompts (chunk 4096) and chunked ones
    (700: rows cut mid-way, chunks with cached past)."""
    loaded = load_model("tiny", dtype=torch.bfloat16, device="cuda", seed=seed % 1000)
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3000, 1800, 400)]
    scored = [SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0) for _ in prompts]

    def prompt_lps(eng):  # float [n - 1] per prompt: log p(token i + 1 | tokens .. i)
        return [torch.tensor([lp[1] for lp in o.prompt_logprobs[1:]]) for o in eng.generate(prompts, scored)]

    dense = prompt_lps(_engine(loaded, 0.0, chunk=chunk))
    full = _engine(loaded, 1.0, chunk=chunk)
    for d, f in zip(dense, prompt_lps(full)):
        rel = float((f - d).norm() / (d - d.mean()).norm())
        worst = int((f - d).abs().argmax())
        print(f"n={d.numel() + 1} rel={rel:.4f} max={float((f - d).abs().max()):.4f} at {worst}")
        assert rel < 0.05, (rel, worst)
    assert full.backend.prefill_tiles[0] == full.backend.prefill_tiles[1] > 0
    assert full.backend.chunk_kernels["bsp"] > 0  # short lists: the cost model picks the bsp kernel
    gathered = _engine(loaded, 1.0, chunk=chunk)
    gathered.backend.bsp_cost = None  # every list through the gathered-cuDNN path
    for d, f in zip(prompt_lps(gathered), prompt_lps(full)):
        assert float((f - d).norm() / (d - d.mean()).norm()) < 0.05
    assert gathered.backend.chunk_kernels["bsp"] == 0 < gathered.backend.chunk_kernels["gathered"]
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True) for _ in prompts]
    sparse = _engine(loaded, 0.8, chunk=chunk)
    outs = sparse.generate(prompts, params)
    assert all(len(o.token_ids) == 8 for o in outs)
    kept, causal = sparse.backend.prefill_tiles
    assert 0 < kept < causal
    torch_sparse = _engine(loaded, 0.8, backend="torch", chunk=chunk)
    torch_sparse.generate(prompts, params)
    # same rule on both backends: kept counts agree up to estimator near-ties in bf16
    assert abs(torch_sparse.backend.prefill_tiles[0] - kept) <= 0.05 * kept
