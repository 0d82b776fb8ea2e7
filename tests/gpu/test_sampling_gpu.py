"""Penalties, logit_bias, min_tokens and logprobs on the cupy backend: decode steps replayed as
CUDA graphs give what the same engine gives eagerly, rows without those features are untouched,
and prompt logprobs (fused forward) are log_softmax of the logits after each prefix."""

from __future__ import annotations

import random

import pytest
import torch
from logits_capture import capture_logits

from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams
from lserve.models.loader import load_model


def _engine(loaded, graphs: bool, fused: bool = True) -> LLMEngine:
    cfg = EngineConfig(model="tiny", device="cuda", backend="cupy", dtype="float32", cuda_graphs=graphs,
                       fused_ops=fused, sparsity=SparsityConfig(pattern="random", static_sparsity=0.5,
                                                                sink_tokens=32, local_tokens=64, token_budget=0),
                       cache=CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=16384), max_num_seqs=4,
                       max_batched_tokens=2048)
    return LLMEngine(cfg, loaded=loaded)


def _params(eos: int) -> list[SamplingParams]:
    plain = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    return [plain,
            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=1.6,
                           frequency_penalty=0.7, presence_penalty=0.4, logit_bias={7: 3.0}, logprobs=4),
            SamplingParams(max_tokens=40, temperature=0, logit_bias={eos: 100.0}, min_tokens=25, logprobs=0),
            plain]


def _run(engine: LLMEngine, prompts, params):
    outs = engine.generate(prompts, params)
    assert engine.cache.all_free()
    return outs


def test_graph_decode_with_penalties_matches_eager(seed):
    loaded = load_model("tiny", dtype=torch.float32, device="cuda", seed=seed % 1000)
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (200, 333, 77, 500)]
    eager = _engine(loaded, False)
    params = _params(eager.eos_ids[0])
    ref = _run(eager, prompts, params)
    eng = _engine(loaded, True)
    got = _run(eng, prompts, params)
    assert eng.graphs.disabled is None and eng.graphs.replays > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for g, r in zip(got[1:3], ref[1:3]):
        assert [e[0] for e in g.logprobs] == g.token_ids
        assert [e[1] for e in g.logprobs] == pytest.approx([e[1] for e in r.logprobs], abs=1e-3)
    assert len(got[2].token_ids) == 26 and got[2].token_ids[-1] == eng.eos_ids[0]  # min_tokens, then the bias
    # the plain rows are what they are without the others in the batch
    alone = _run(_engine(loaded, True), [prompts[0], prompts[3]], [params[0], params[3]])
    assert [o.token_ids for o in alone] == [got[0].token_ids, got[3].token_ids]


def test_prompt_logprobs_fused_forward(seed):
    loaded = load_model("tiny", dtype=torch.float32, device="cuda", seed=seed % 1000)
    eng = _engine(loaded, True)
    assert eng.model.fused is not None
    rng = random.Random(seed)
    ids = [rng.randrange(256) for _ in range(40)]
    out = eng.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    seen = capture_logits(eng)
    for i in (1, 17, 39):
        eng.generate([ids[:i]], SamplingParams(max_tokens=1, temperature=0))
        ref = torch.log_softmax(seen[-1][0], dim=-1)
        tok, lp, top = out.prompt_logprobs[i]
        assert tok == ids[i] and lp == pytest.approx(ref[ids[i]].item(), abs=1e-3)
        assert [t for t, _ in top] == ref.topk(3).indices.tolist()
