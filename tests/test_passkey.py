"""The default model finds a 5-digit passkey in 2k tokens of filler: dense and with dynamic page
selection at a 512-token budget (streaming heads are covered by the reference tests)."""

from __future__ import annotations

import pytest

from lserve.config import EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.eval.passkey import make_passkey


@pytest.mark.parametrize("mode", ["dense", "dynamic-512"])
def test_passkey_2k(smol, mode):
    sp = SparsityConfig(token_budget=0) if mode == "dense" else SparsityConfig(token_budget=512, reuse_interval=4)
    eng = LLMEngine(EngineConfig(model="default", sparsity=sp, max_batched_tokens=2048), smol)
    cases = [make_passkey(smol.tokenizer, 2048, d) for d in (0.1, 0.5, 0.9)]
    assert all(abs(c.num_tokens - 2048) <= 1 for c in cases)
    outs = eng.generate([c.prompt_ids for c in cases], SamplingParams(max_tokens=8, temperature=0))
    for c, o in zip(cases, outs):
        assert c.answer in o.text, f"depth {c.depth}: expected {c.answer}, got {o.text!r}"
    if mode != "dense":
        # Selection really ran (2048 tokens are 32 pages of 64, the budget keeps 8) and was reused.
        st = eng.backend.selector_stats
        assert st.runs > 0 and st.reuses > 0 and st.pages == st.runs * 3 * 8  # 3 KV heads x 8 pages
