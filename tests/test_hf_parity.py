"""Dense mode (no sparsity) matches Hugging Face transformers on the default model."""

from __future__ import annotations

import torch
from logits_capture import capture_logits

from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.eval.passkey import FILLER


def _prompt(tok, n):
    return tok.encode("Notes on the weather. " + FILLER * (n // 10))[:n]


def test_last_token_logits_match_transformers(smol, hf_smol):
    ids = _prompt(smol.tokenizer, 500)
    assert len(ids) == 500
    with torch.inference_mode():
        ref = hf_smol(torch.tensor([ids])).logits[0, -1].float()
    # Chunked prefill over pages of 16 tokens, so the cached-past path is exercised too.
    eng = LLMEngine(EngineConfig(model="default", sparsity=SparsityConfig(token_budget=0), max_batched_tokens=192,
                                 cache=CacheConfig(page_size=16, logical_page_size=4)), smol)
    seen = capture_logits(eng)
    eng.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    ours = seen[-1][0]
    assert (ours - ref).abs().max().item() < 1e-3 * ref.abs().max().item()
    assert torch.argmax(ours) == torch.argmax(ref)


def test_greedy_32_tokens_identical_to_transformers_generate(smol, hf_smol):
    ids = _prompt(smol.tokenizer, 300)
    with torch.inference_mode():
        ref = hf_smol.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                               pad_token_id=2)[0, len(ids):].tolist()
    eng = LLMEngine(EngineConfig(model="default"), smol)
    out = eng.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == ref


def test_full_budget_without_streaming_equals_dense(smol):
    """Sparsity on, but a budget covering the whole context and no streaming heads: same as dense."""
    ids = _prompt(smol.tokenizer, 400)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    cache = CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=4096)  # not 64k: two engines
    dense = LLMEngine(EngineConfig(model="default", sparsity=SparsityConfig(token_budget=0), cache=cache), smol)
    sparse = LLMEngine(EngineConfig(model="default", cache=cache, sparsity=SparsityConfig(
        token_budget=1024, reuse_interval=4, pattern="random", static_sparsity=0.0)), smol)
    seen_d, seen_s = capture_logits(dense), capture_logits(sparse)
    a = dense.generate([ids], params)[0]
    b = sparse.generate([ids], params)[0]
    assert a.token_ids == b.token_ids
    assert all(torch.equal(x, y) for x, y in zip(seen_d, seen_s))
