"""The host-tier bench's time model: today's H200 rows, block-sparse prefill, calibration by a measured row."""

from __future__ import annotations

import pytest

from lserve.bench.host_tier_time import TimeModel, prefill_chunks
from lserve.engine.step_budget import attention_alpha

ALPHA = attention_alpha(4096, 14336, 32, 8, 128, [16] * 32)  # llama3-8b, half the KV heads streaming
MODEL = TimeModel(ALPHA, host_bytes_per_token=18432, max_batched_tokens=8192)


def _run(mode, ctx, **kw):
    return {"mode": mode, "context": ctx, "resident_tokens": 65536 if mode == "tier" else 0, **kw}


def test_chunks_as_the_scheduler_cut_them_on_the_h200():
    # benchmarks/host_tier/host_tier_h200.log: the tier 16 chunks of 8192, all-GPU 36 shrinking ones
    assert [n for _, n in prefill_chunks(131072, 8192, 0.0)] == [8192] * 16
    gpu = prefill_chunks(131072, 8192, ALPHA)
    assert len(gpu) == 36 and gpu[0] == (0, 8192) and gpu[-1] == (129024, 2048)
    assert sum(n for _, n in gpu) == 131072


def test_the_model_gives_the_measured_128k_ttfts_within_15_percent():
    assert MODEL.prefill_s(_run("tier", 131072)) == pytest.approx(9.51, rel=0.15)
    assert MODEL.prefill_s(_run("gpu", 131072)) == pytest.approx(12.09, rel=0.15)


def test_prefill_grows_faster_than_the_context_and_block_sparse_prefill_cuts_it():
    for mode in ("tier", "gpu"):
        t128, t1m = MODEL.prefill_s(_run(mode, 131072)), MODEL.prefill_s(_run(mode, 1048576))
        assert t1m > 20 * t128  # 8x the tokens, attention 64x
        assert MODEL.prefill_s(_run(mode, 1048576), MODEL.kept(0.2)) < 0.6 * t1m
    assert MODEL.kept(0) == 1.0 and MODEL.kept(0.2) == pytest.approx(0.2 * 1.2 + 1 / 32)


def test_a_measured_row_scales_later_runs_of_its_mode_and_gives_its_kept_fraction():
    run = _run("tier", 524288, prefill_sparsity=0.2, host_kv_gib=10.0)
    prior = MODEL.estimate_s(run, [], decode_steps=32)
    ref = _run("tier", 131072, prefill_sparsity=0.2, decode_ms_per_token=6.0)
    ref["ttft_s"] = 2 * MODEL.prefill_s(ref, MODEL.kept(0.2))
    doubled = MODEL.estimate_s(run, [ref], decode_steps=32)
    assert doubled - prior == pytest.approx(MODEL.prefill_s(run, MODEL.kept(0.2)), rel=0.02)
    # a measured kept fraction (lower than the prior's) is used for the same tau
    low = {**ref, "prefill_kept_fraction": 0.05}
    low["ttft_s"] = MODEL.prefill_s(low, MODEL.row_kept(low))
    assert MODEL.estimate_s(run, [low], 32) < prior
    # a cut row or a row of the other mode does not calibrate
    assert MODEL.estimate_s(run, [{**ref, "mode": "gpu"}, {"mode": "tier", "context": 1 << 20, "cut": True}], 32) \
        == pytest.approx(prior)
