"""Dynamic block-sparse prefill: block-list invariants and blocked attention against a masked reference."""

import pytest
import torch

from lserve.attention.block_sparse_prefill import blocked_prefill, sparse_prefill
from lserve.sparsity.prefill_blocks import (
    combine_group,
    estimate_masses,
    mandatory_tiles,
    oracle_at_counts,
    prefill_blocks,
    recalled_mass,
)


def _inputs(h, g, start, lq, d, seed=0, peaked=False):
    gen = torch.Generator().manual_seed(seed)
    L = start + lq
    q = torch.randn(h * g, lq, d, generator=gen)
    k = torch.randn(h, L, d, generator=gen)
    v = torch.randn(h, L, d, generator=gen)
    if peaked:  # a few keys aligned with every query: attention concentrates there
        spike = torch.randn(h, 1, d, generator=gen) * 3
        k[:, L // 3: L // 3 + 4] += spike
        q += spike.repeat_interleave(g, 0)
    return q, k, v


@pytest.mark.parametrize("estimator", ["antidiagonal", "bound", "oracle"])
@pytest.mark.parametrize("start,lq", [(0, 200), (70, 133)])
def test_block_list_invariants(estimator, start, lq):
    h, g, d, B = 2, 4, 32, 16
    q, k, _ = _inputs(h, g, start, lq, d, peaked=True)
    L = start + lq
    must, causal = mandatory_tiles(start, L, B)
    full = prefill_blocks(q, k, start, B, d ** -0.5, 1.0, estimator, stride=4)
    assert torch.equal(full.block_mask(), causal[None].expand(h, -1, -1))
    assert full.kept_fraction() == 1.0
    part = prefill_blocks(q, k, start, B, d ** -0.5, 0.5, estimator, stride=4)
    bm = part.block_mask()
    assert bool((bm | ~must[None]).all()), "sink, diagonal and local tiles are always kept"
    assert not bool((bm & ~causal[None]).any())
    for i in range(h):
        for r in range(part.n_rows):
            row = part.row(i, r)
            assert bool((row[1:] > row[:-1]).all())
    assert part.kept_fraction() < 1.0


@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("start,lq", [(0, 150), (96, 77), (45, 100)])
def test_blocked_attention_matches_masked_reference(g, d, start, lq):
    h, B = 2, 32
    q, k, v = _inputs(h, g, start, lq, d, seed=g + d + start)
    blocks = prefill_blocks(q, k, start, B, d ** -0.5, 0.6, "antidiagonal", stride=8)
    out = blocked_prefill(q, k, v, blocks, d ** -0.5)
    mask = blocks.token_mask().repeat_interleave(g, 0)  # [Hq, Lq, L]
    s = torch.bmm(q, k.repeat_interleave(g, 0).transpose(1, 2)) * d ** -0.5
    ref = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v.repeat_interleave(g, 0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("start,lq,qb", [(0, 300, 64), (96, 177, 32), (45, 200, 64), (130, 9, 32)])
def test_sparse_prefill_matches_blocked_reference(g, d, start, lq, qb):
    """The fast path (gathered past + causal own span, merged by log-sum-exp) computes the same
    attention as the masked reference, rows larger than KV blocks, chunks starting mid-row."""
    h, B = 2, 16
    q, k, v = _inputs(h, g, start, lq, d, seed=g * d + start, peaked=True)
    blocks = prefill_blocks(q, k, start, B, d ** -0.5, 0.6, "antidiagonal", stride=8, q_block=qb)
    assert blocks.kept_fraction() < 1.0 or start + lq <= 2 * qb
    out = sparse_prefill(q, k, v, blocks, d ** -0.5)
    ref = blocked_prefill(q, k, v, blocks, d ** -0.5)
    # fp32 both, summed in another order by torch's fused CPU kernel: 2.2e-5 apart on some CPUs
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=2e-5)


@pytest.mark.parametrize("estimator", ["antidiagonal", "bound"])
def test_rows_keep_one_quantized_count_per_row(estimator):
    """Every KV head of a row keeps the same count, a multiple of q_block // block (or every
    causal tile), own-span blocks included; the extra tiles only add mass."""
    h, g, d, B, qb = 4, 2, 32, 16, 64
    q, k, _ = _inputs(h, g, 0, 640, d, seed=11, peaked=True)
    blocks = prefill_blocks(q, k, 0, B, d ** -0.5, 0.5, estimator, stride=8, q_block=qb)
    must, causal = mandatory_tiles(0, 640, B, qb)
    counts = blocks.indptr[:, 1:] - blocks.indptr[:, :-1]  # [H, R]
    assert bool((counts == counts[:1]).all())
    n_causal = causal.sum(-1)
    assert bool(((counts[0] % (qb // B) == 0) | (counts[0] == n_causal)).all())
    assert bool((blocks.block_mask() | ~must[None]).all())
    assert blocks.kept_fraction() < 0.9
    ests = estimate_masses(q, k, 0, B, d ** -0.5, estimator, stride=8, q_block=qb)
    torch.testing.assert_close(ests.sum(-1), torch.ones(h * g, blocks.n_rows))


def test_full_blocks_equal_causal_attention():
    h, g, d, start, lq = 2, 4, 64, 40, 90
    q, k, v = _inputs(h, g, start, lq, d, seed=3)
    blocks = prefill_blocks(q, k, start, 16, d ** -0.5, 1.0, "bound")
    out = blocked_prefill(q, k, v, blocks, d ** -0.5)
    ke, ve = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    keep = torch.ones(lq, start + lq, dtype=torch.bool).tril(start)
    ref = torch.nn.functional.scaled_dot_product_attention(q[None], ke[None], ve[None], attn_mask=keep)[0]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_oracle_at_same_counts_recalls_at_least_as_much():
    h, g, d, start, lq, B = 2, 4, 32, 0, 256, 16
    q, k, _ = _inputs(h, g, start, lq, d, seed=5, peaked=True)
    exact_q = estimate_masses(q, k, start, B, d ** -0.5, "oracle")
    torch.testing.assert_close(exact_q.sum(-1), torch.ones(h * g, exact_q.shape[1]))
    est = prefill_blocks(q, k, start, B, d ** -0.5, 0.8, "bound")
    best = oracle_at_counts(combine_group(exact_q, g), est)
    assert best.indices.numel() == est.indices.numel()
    assert float(recalled_mass(exact_q, best, g).mean()) >= float(recalled_mass(exact_q, est, g).mean()) - 1e-6


def _prefill_engine(model, loaded, tau, **sp):
    from lserve.config import CacheConfig, EngineConfig, SparsityConfig
    from lserve.engine import LLMEngine

    cfg = EngineConfig(model=model, cache=CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=4096),
                       max_batched_tokens=96,  # chunked: later chunks attend to cached blocks (start > 0)
                       sparsity=SparsityConfig(pattern="random", static_sparsity=0.5, sink_tokens=16, local_tokens=16,
                                               token_budget=0, prefill_sparsity=tau, prefill_sparsity_min_len=128,
                                               prefill_block=16, prefill_q_block=32, **sp))
    return LLMEngine(cfg, loaded) if loaded is not None else LLMEngine(cfg)


@pytest.mark.parametrize("model", ["tiny", "default"])
def test_engine_prefill_sparsity(model, request):
    from lserve.engine import SamplingParams

    loaded = request.getfixturevalue("smol") if model == "default" else None
    prompt = " ".join(f"item {i} is {i * 7 % 13}." for i in range(60))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    off = _prefill_engine(model, loaded, 0.0).generate([prompt], params)[0].token_ids
    full = _prefill_engine(model, loaded, 1.0)
    assert full.generate([prompt], params)[0].token_ids == off
    assert full.backend.prefill_tiles[0] == full.backend.prefill_tiles[1] > 0  # tau 1: every causal tile
    for est in ("antidiagonal", "bound"):
        sparse = _prefill_engine(model, loaded, 0.9, prefill_estimator=est)
        assert len(sparse.generate([prompt], params)[0].token_ids) == 6
        kept, causal = sparse.backend.prefill_tiles
        assert 0 < kept < causal


def test_prompt_tail_rows_keep_every_causal_tile():
    h, g, d, B, qb = 2, 4, 32, 16, 64
    start, lq = 70, 300
    q, k, _ = _inputs(h, g, start, lq, d, peaked=True)
    L = start + lq
    _, causal = mandatory_tiles(start, L, B, qb)
    plain = prefill_blocks(q, k, start, B, d ** -0.5, 0.5, "antidiagonal", stride=4, q_block=qb)
    tail = prefill_blocks(q, k, start, B, d ** -0.5, 0.5, "antidiagonal", stride=4, q_block=qb, dense_from=L - qb)
    pm, tm = plain.block_mask(), tail.block_mask()
    ends = [tail.row_span(r)[1] for r in range(tail.n_rows)]
    dense_rows = [r for r, e in enumerate(ends) if e > L - qb]
    assert dense_rows == [tail.n_rows - 2, tail.n_rows - 1]  # the last qb positions span two rows here
    for r in range(tail.n_rows):
        if r in dense_rows:
            assert torch.equal(tm[:, r], causal[None, r].expand(h, -1))
        else:
            assert torch.equal(tm[:, r], pm[:, r])
    assert not torch.equal(pm[:, dense_rows], tm[:, dense_rows])  # the cut did drop tiles there
    whole = prefill_blocks(q, k, start, B, d ** -0.5, 0.5, "antidiagonal", stride=4, q_block=qb, dense_from=start)
    assert whole.kept_fraction() == 1.0


def test_engine_prefill_sparsity_keeps_the_passkey(smol):
    """A user's retrieval prompt with prefill sparsity on still finds its key: the cut must not
    reach the prompt's last rows, whose outputs are the first token (it did, and answered noise)."""
    from lserve.config import CacheConfig, EngineConfig, SparsityConfig
    from lserve.engine import LLMEngine, SamplingParams
    from lserve.eval.tasks import make_passkey_case

    case = make_passkey_case(smol.tokenizer, 2048, 0.5, seed=0)
    sp = SparsityConfig(pattern=None, token_budget=0, prefill_sparsity=0.9, prefill_sparsity_min_len=0,
                        prefill_q_block=256)
    eng = LLMEngine(EngineConfig(model="default", sparsity=sp, cache=CacheConfig(dense_pool_tokens=2400),
                                 max_model_len=2400, max_batched_tokens=4096), smol)
    out = eng.generate([case.prompt_ids], SamplingParams(max_tokens=8, temperature=0))[0]
    kept, causal = eng.backend.prefill_tiles
    assert kept < 0.95 * causal  # the rest of the prompt did run sparse
    assert case.answers[0] in out.text, out.text


def test_prefill_sparsity_config_checked_once():
    from lserve.config import ConfigError, SparsityConfig

    for bad in ({"prefill_sparsity": 1.5}, {"prefill_sparsity": -0.1}, {"prefill_block": 12},
                {"prefill_estimator": "magic"}, {"prefill_sparsity_min_len": -2}):  # -1: auto
        with pytest.raises(ConfigError):
            SparsityConfig(**bad)


def test_per_request_prefill_sparsity(smol):
    from lserve.engine import SamplingParams

    eng = _prefill_engine("default", smol, 0.0)
    prompt = " ".join(f"item {i} is {i * 7 % 13}." for i in range(60))
    eng.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert eng.backend.prefill_tiles == [0, 0]  # engine default: off
    eng.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prefill_sparsity=0.9))
    kept, causal = eng.backend.prefill_tiles
    assert 0 < kept < causal
    with pytest.raises(ValueError):
        SamplingParams(prefill_sparsity=2.0)


def test_lserve_extension_accepts_prefill_sparsity():
    """The schema takes the field; its range is the engine's rule (one validator), applied by the
    ingress before admission with the request's field name."""
    pytest.importorskip("pydantic")
    from lserve.serve.params import engine_fields
    from lserve.serve.protocol import CompletionRequest, LServeOptions, OpenAIError

    assert LServeOptions(prefill_sparsity=0.9).prefill_sparsity == 0.9
    ok = CompletionRequest(prompt="hi", lserve=LServeOptions(prefill_sparsity=0.9))
    assert engine_fields(ok)["prefill_sparsity"] == 0.9
    with pytest.raises(OpenAIError) as e:
        engine_fields(CompletionRequest(prompt="hi", lserve=LServeOptions(prefill_sparsity=1.5)))
    assert e.value.status == 400 and e.value.param == "lserve.prefill_sparsity", vars(e.value)


def test_sparse_prefill_chunks_end_on_the_row_grid():
    """A chunked block-sparse prefill moves in whole rows of prefill_q_block queries (a partial
    row gives the GPU's fused kernels a new shape per chunk); a dense prefill keeps its chunks."""
    from lserve.config import SparsityConfig
    from lserve.engine import LLM, SamplingParams

    prompt = [10 + i % 200 for i in range(1000)]
    runs = {}
    for tau in (0.9, 0.0):
        sp = SparsityConfig(pattern=None, token_budget=0, prefill_sparsity=tau, prefill_sparsity_min_len=0,
                            prefill_block=64, prefill_q_block=128)
        llm = LLM("tiny", sparsity=sp, max_batched_tokens=300)
        llm.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        ends, done = [], 0
        while llm.has_unfinished():
            llm.step()
            done += llm.last_step_info["prefill_tokens"]
            ends.append(done)
        runs[tau] = ends
    sparse, dense = runs[0.9], runs[0.0]
    assert sparse[-1] == dense[-1] == 1000 and len(sparse) > 2
    assert all(e % 128 == 0 for e in sparse[:-1]), sparse
    assert dense[0] == 300 and any(e % 128 for e in dense[:-1]), dense


def test_long_prompt_chunks_end_on_the_backend_grid_only_without_decodes():
    """Where the backend runs grid-aligned chunks faster (cuDNN on a GPU), a long prompt's
    prefill-only chunks end on its grid; chunks next to decodes keep the step budget's size."""
    from lserve.engine import LLM, SamplingParams

    llm = LLM("tiny", max_batched_tokens=300)
    llm.backend.chunk_align = lambda prompt_tokens: 128 if prompt_tokens >= 900 else 0
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm.add_request([10 + i % 200 for i in range(1000)], params)
    alone = []
    while llm.sequence("req-0").num_computed < 1000:
        llm.step()
        alone.append((llm.last_step_info["decode"], llm.sequence("req-0").num_computed))
    assert len(alone) > 2 and all(d == 0 for d, _ in alone)
    assert all(e % 128 == 0 for _, e in alone[:-1]) and alone[-1][1] == 1000, alone
    llm.add_request([7 + i % 100 for i in range(1000)], params)  # prefills while req-0 decodes
    mixed = []
    while llm.sequence("req-1").num_computed < 1000:
        llm.step()
        mixed.append((llm.last_step_info["decode"], llm.sequence("req-1").num_computed))
    assert any(d > 0 and e % 128 for d, e in mixed[:-1]), mixed
    while llm.has_unfinished():
        llm.step()


def test_engine_budget_learns_the_share_block_sparse_chunks_compute():
    """The engine reports to its step budget, after each step with block-sparse chunks, the share
    of the dense heads' causal tiles they computed: a chunk below the length runs dense and counts
    whole; later ones keep less. The count of causal tiles the budget's share divides by is the one
    the block lists count (every layer sparse here, at a fixed tau)."""
    from lserve.engine import SamplingParams
    eng = _prefill_engine("tiny", None, 0.5)
    eng.add_request([10 + i % 300 for i in range(480)], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    budget = eng.scheduler.budget
    seq = eng.sequence("req-0")
    shares = []
    while eng.has_unfinished():
        start, tiles0 = seq.num_computed, list(eng.backend.prefill_tiles)
        eng.step()
        chunk = [(start, seq.num_computed)]
        shares.append(eng.backend.prefill_computed_share(tiles0, chunk))
        if start + 96 > 128:  # at or past the length: every layer ran block-sparse
            kept, causal = (a - b for a, b in zip(eng.backend.prefill_tiles, tiles0))
            assert shares[-1] == kept / causal
    assert shares[0] == 1.0 and min(shares) < 0.9, shares
    assert 0 < budget.sparse_kept < 1.0 and budget.sparse_share < 1.0
    assert budget.cost(96, 400, sparse=True) < budget.cost(96, 400)
