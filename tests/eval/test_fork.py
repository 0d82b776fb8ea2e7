"""Forking a prefilled sequence into budget variants gives exactly what separate runs give."""

from __future__ import annotations

import random

import pytest
import torch

from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.eval.fork import generate_variants
from lserve.models.loader import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=5)


def _engine(tiny, kv_quant="none", reuse=2):
    sp = SparsityConfig(pattern="random", static_sparsity=0.5, sink_tokens=16, local_tokens=32, token_budget=64,
                        reuse_interval=reuse)
    cc = CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=16 * 512, kv_quant=kv_quant)
    # Room for both prompts in one step: forked and separate runs then cut the same prefill chunks
    # (numerics depend on where chunks end: a chunk attends to its own K/V unquantized, to the
    # cached past as stored, e.g. INT8), which shortest-first scheduling of shared steps would not keep.
    # No prefix cache: a separate run of a prompt seen before would resume after its cached pages,
    # i.e. end a chunk there.
    return LLMEngine(EngineConfig(model="tiny", sparsity=sp, cache=cc, max_num_seqs=16, max_batched_tokens=1024,
                                  prefix_cache=False), tiny)


@pytest.mark.parametrize("kv_quant", ["none", "int8"])
def test_forked_variants_equal_separate_runs(tiny, kv_quant):
    torch.manual_seed(0)
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (300, 229)]
    budgets = [0, 32, 64, 128]  # off, and 2 / 4 / 8 pages of 16 tokens (the prompts hold 15-19 pages)
    params = [[SamplingParams(max_tokens=12, temperature=0, token_budget=b, ignore_eos=True) for b in budgets]
              for _ in prompts]
    eng = _engine(tiny, kv_quant)
    forked = generate_variants(eng, prompts, params)
    assert eng.cache.dense_alloc.num_used == 0 and eng.cache.stream_alloc.num_used == 0  # all pages returned
    sel = eng.backend.selector_stats
    assert sel.runs > 0 and sel.reuses > 0  # page selection really ran in the forked copies
    ref_eng = _engine(tiny, kv_quant)
    for p, ps, outs in zip(prompts, params, forked):
        for b, sp, o in zip(budgets, ps, outs):
            ref = ref_eng.generate([p], sp)[0]
            assert o.token_ids == ref.token_ids, f"budget {b}"
            assert o.text == ref.text
    # Different budgets do change something here (the test is not vacuous).
    assert len({tuple(o.token_ids) for row in forked for o in row}) > 1


def test_single_variant_and_eos_at_first_token(tiny):
    eng = _engine(tiny)
    p = [random.Random(2).randrange(256) for _ in range(200)]
    one = generate_variants(eng, [p], [[SamplingParams(max_tokens=1, temperature=0)]])
    two = generate_variants(eng, [p], [[SamplingParams(max_tokens=1, temperature=0, token_budget=b) for b in (0, 32)]])
    assert one[0][0].token_ids == two[0][0].token_ids == two[0][1].token_ids
    with pytest.raises(ValueError):
        generate_variants(eng, [p], [[]])


def test_reuse_interval_override_equals_engine_setting(tiny):
    """Variants decoding with C' = 1, 3 on an engine run with C = 2 match engines run with C' itself."""
    p = [random.Random(3).randrange(256) for _ in range(280)]
    sp = SamplingParams(max_tokens=14, temperature=0, token_budget=48, ignore_eos=True)
    eng = _engine(tiny, reuse=2)
    out = generate_variants(eng, [p], [[sp, sp, sp]], reuse=[[1, None, 3]])[0]
    runs = 0
    for c, o in zip((1, 2, 3), out):
        ref = _engine(tiny, reuse=c)
        assert o.token_ids == ref.generate([p], sp)[0].token_ids, f"C={c}"
        runs += ref.backend.selector_stats.runs
    # The variants' selector runs add up to those of the three reference engines (C' is not ignored).
    assert eng.backend.selector_stats.runs == runs
