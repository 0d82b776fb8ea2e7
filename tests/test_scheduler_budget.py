"""Scheduling past long prefills: shortest-remaining prefill first, attention-aware chunk costs,
and the time-targeted step budget (lserve.engine.step_budget)."""

from __future__ import annotations

import asyncio
import time

import pytest

from lserve.engine import LLM, SamplingParams
from lserve.engine.step_budget import StepBudget, attention_alpha


def test_short_prompt_is_prefilled_past_a_long_one():
    """Token budget 512: a 40-token prompt that arrives after the first chunk of a 3000-token one
    is prefilled in the next step (and yields its token there) instead of after the long one."""
    llm = LLM("tiny", max_batched_tokens=512)
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    long_id = llm.add_request([10 + i % 400 for i in range(3000)], greedy)
    llm.step()
    short_id = llm.add_request(list(range(10, 50)), greedy)
    outs = llm.step()
    assert [o.request_id for o in outs] == [short_id]
    # the long prompt took what was left (in token-equivalents: its chunks cost more as it grows)
    assert 40 < llm.last_step_info["prefill_tokens"] <= 512
    done = {}
    while llm.has_unfinished():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    assert len(done[long_id].token_ids) == 2  # and still finished


def test_chunk_cost_grows_with_the_past():
    b = StepBudget(8192, alpha=1.87e-5)  # Llama-3-8B with half the KV heads streaming
    assert b.tokens_within(8192, 0, 10**6) > 3 * b.tokens_within(8192, 131072, 10**6)
    assert b.tokens_within(8192, 0, 100) == 100
    assert abs(b.cost(b.tokens_within(5000, 60000, 10**6), 60000) - 5000) < 10


def test_a_prompt_of_max_batched_tokens_is_one_step():
    """max_batched_tokens keeps vLLM's meaning for a fresh prompt (the benchmarks time one-step
    prefill with it); only chunks with a past are shrunk by their attention cost."""
    b = StepBudget(8192, alpha=3.3e-4)  # the default model: attention is a third of a 2k prompt's FLOPs
    assert b.tokens_within(b.prefill_budget(0), 0, 10**6) == 8192
    assert b.tokens_within(b.prefill_budget(0), 8192, 10**6) < 8192
    for n in (8260, 8259, 131152, 262224):  # the e2e bench's prompts, llama3-8b's alpha: the root rounds down
        b = StepBudget(n, alpha=attention_alpha(4096, 14336, 32, 8, 128, [32] * 32))
        assert b.tokens_within(b.prefill_budget(0), 0, n) == n
    llm = LLM("tiny", max_batched_tokens=1500)
    llm.add_request([10 + i % 200 for i in range(1500)], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    outs = llm.step()
    assert llm.last_step_info["prefill_tokens"] == 1500 and outs and outs[0].finished


def simulate(budget: StepBudget, steps: int, overhead_mixed: float, decode_s: float, rate: float,
             mixed_rate: float | None = None, timed: bool = True, seconds: list | None = None) -> list[float]:
    """Steps of a device whose step takes (decode-only) ``decode_s``, or ``overhead_mixed`` +
    cost / ``mixed_rate`` (default ``rate``) when it prefills next to decodes, cost / ``rate`` when
    it only prefills; ``timed``: the engine timed the mixed steps' prefill part apart (CUDA events).
    Returns the budgets mixed steps were given (their seconds appended to ``seconds``)."""
    budgets, mixed_rate = [], mixed_rate or rate
    budget.observe(4096, 0, 4096 / rate)  # a prefill-only step first (warm-up)
    for i in range(steps):
        if i % 3 == 0:
            budget.observe(0, 4, decode_s)
            continue
        room = max(budget.prefill_budget(4), budget.min_chunk)  # the scheduler's first chunk always progresses
        budgets.append(room)
        prefill_s = room / mixed_rate
        budget.observe(room, 4, overhead_mixed + prefill_s, prefill_s if timed else None)
        if seconds is not None:
            seconds.append(overhead_mixed + prefill_s)
    return budgets


def test_mixed_step_overhead_is_not_taken_for_prefill_time():
    """An eager mixed step costs 40 ms before any prefill: with a 100 ms ITL SLO its prefill gets
    what is left of 90 ms (the SLO's aim) instead of collapsing to the minimum chunk, timed apart
    or not (then the overhead is counted as slow prefill, and the budget still settles there)."""
    for timed in (True, False):
        b = StepBudget(8192, target_s=0.25, itl_slo_s=0.1, min_chunk=32)
        secs: list[float] = []
        budgets = simulate(b, 90, overhead_mixed=0.04, decode_s=0.005, rate=60000.0, timed=timed, seconds=secs)
        assert budgets[-1] == pytest.approx((0.09 - 0.04) * 60000, rel=0.1), timed
        assert min(budgets[5:]) > 1000
        assert max(secs[-20:]) == pytest.approx(0.09, rel=0.05)


def test_slower_prefill_next_to_decodes_does_not_grow_the_step():
    """Prefill next to decodes 1.5x slower than in prefill-only steps (the H200's flash chunks
    against cuDNN ones): mixed steps settle within the ITL SLO, instead of the slower prefill
    being taken for overhead, raising the next budget, up to the time target (the H200 served
    128k at concurrency 4 with 200-330 ms inter-token gaps that way)."""
    for timed in (True, False):
        b = StepBudget(8192, target_s=0.25, itl_slo_s=0.05, min_chunk=32)
        secs: list[float] = []
        simulate(b, 90, overhead_mixed=0.004, decode_s=0.006, rate=60000.0, mixed_rate=40000.0, timed=timed,
                 seconds=secs)
        assert b.mixed_rate == pytest.approx(40000.0, rel=0.3)
        assert max(secs[-20:]) == pytest.approx(0.045, rel=0.1), timed  # the SLO's aim, not 0.25 s
        assert max(secs[len(secs) // 3:]) < 0.05


def test_slow_decodes_leave_prefill_its_share():
    """Decodes alone take longer than the ITL SLO (many long requests): the SLO leaves prefill
    nothing, and the floor still gives it min_prefill_share of those steps' time, counted at the
    prefill-only rate, whatever their fixed cost (here 0.2 s, and prefill 1.5x slower there)."""
    for share in (0.3, 0.5):
        b = StepBudget(10**6, target_s=0.25, itl_slo_s=0.1, min_prefill_share=share, min_chunk=32)
        secs: list[float] = []
        budgets = simulate(b, 120, overhead_mixed=0.2, decode_s=0.15, rate=60000.0, mixed_rate=40000.0, seconds=secs)
        got = [room / 60000.0 / s for room, s in zip(budgets[-20:], secs[-20:])]
        assert min(got) > 0.9 * share and max(got) < 1.3 * share, (share, got)


def test_itl_slo_needs_no_step_target():
    """``itl_slo_s`` alone turns the time model on for steps with decodes; prefill-only steps keep
    the token cap (a prompt of max_batched_tokens tokens is one step)."""
    b = StepBudget(4096, target_s=0.0, itl_slo_s=0.05)
    assert b.timed and b.prefill_budget(0) == b.cap
    b.observe(4096, 0, 4096 / 60000.0)
    assert b.prefill_budget(0) == b.cap
    assert b.prefill_budget(2) < 0.05 * 60000
    with pytest.raises(ValueError):
        StepBudget(4096, min_prefill_share=1.0)


def test_prefill_only_steps_follow_the_time_target():
    b = StepBudget(10**6, target_s=0.2)
    assert b.prefill_budget(0) == 8 * b.min_chunk  # nothing measured yet: a small first step
    for _ in range(10):
        room = b.prefill_budget(0)
        b.observe(room, 0, 0.002 + room / 5000.0)
    assert b.prefill_budget(0) == pytest.approx(0.2 * 5000, rel=0.05)


def test_short_request_ttft_during_long_prefill_cpu():
    """The serving engine (time-targeted steps) on the default model: a short request sent during
    the prefill of a long prompt gets its first token within a few engine steps, long before the
    long prompt's first token. Counted in steps, not seconds: on a loaded CI machine a step's
    wall time varies several-fold (the wall-time target lives in the serve benchmarks)."""
    from lserve.engine.async_engine import AsyncEngine
    from lserve.serve.settings import ServeSettings

    cfg = ServeSettings(device="cpu", max_model_len=4096, max_cache_tokens=8192, token_budget=0).engine_config()
    engine = AsyncEngine(cfg)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    long_ids, short_ids = list(range(1000, 4000)), list(range(500, 530))
    marks = {}

    async def first_token(name, ids, delay=0.0):
        await asyncio.sleep(delay)
        t0, s0 = time.perf_counter(), engine.stats().steps
        async for out in engine.generate(ids, params):
            if out.token_ids:
                marks[name] = (time.perf_counter() - t0, engine.stats().steps - s0, time.perf_counter())
                return

    async def run():
        await first_token("warm", short_ids)
        await asyncio.gather(first_token("long", long_ids), first_token("short", short_ids, delay=1.0))

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    (short_s, short_steps, short_at), (long_s, long_steps, long_at) = marks["short"], marks["long"]
    print(f"short: {short_s:.3f} s, {short_steps} steps; long: {long_s:.2f} s, {long_steps} steps")
    assert long_steps >= 6, "the long prompt must take several chunked steps"
    assert short_at < long_at, "the short request must not wait for the long prefill"
    # the step in flight when it arrives, its own step, and one of async output hand-off
    assert short_steps <= 3, f"short request took {short_steps} steps during a long prefill"
    # FCFS would make it wait for the rest of the long prefill (long_s - 1 s)
    assert short_s < 0.5 * (long_s - 1.0), f"short TTFT {short_s:.3f} s vs long {long_s:.2f} s"


def test_block_sparse_chunks_cost_what_they_compute():
    """A block-sparse chunk's attention to its past costs the share of causal tiles such chunks
    computed lately plus the estimate's share: dense until one is measured, then cheaper deep in a
    prompt, so a time-targeted budget gives it more tokens there (and learns the device's true rate)."""
    b = StepBudget(8192, alpha=1.87e-5, estimate_share=1 / 32)
    assert b.cost(2048, 100000, sparse=True) == b.cost(2048, 100000)  # nothing measured: dense
    b.observe_sparse(0.25)
    assert b.sparse_share == pytest.approx(0.25 + 1 / 32)
    assert b.cost(2048, 0, sparse=True) == pytest.approx(b.cost(2048, 0), rel=0.03)  # no past: the GEMMs
    deep = b.cost(2048, 131072, sparse=True) - 2048
    assert deep == pytest.approx(0.28125 * (b.cost(2048, 131072) - 2048))
    assert b.tokens_within(8192, 131072, 10**6, sparse=True) > 2 * b.tokens_within(8192, 131072, 10**6)
    b.observe_sparse(1.5)  # a share is clamped to [0, 1]
    assert b.sparse_kept <= 1.0


def _rows_scheduler(budget: StepBudget, row: int = 256):
    """A scheduler whose prompts are all prefilled block-sparse on a ``row``-token grid."""
    import torch

    from lserve.cache.kv_cache import KVCache
    from lserve.config import CacheConfig
    from lserve.engine.scheduler import ChunkRule, Scheduler
    from lserve.models.presets import preset_config

    cache = KVCache(preset_config("tiny"), CacheConfig(dense_pool_tokens=16384), [1] * 4, 64, 256, 4,
                    torch.float32, "meta")
    return Scheduler(cache, 4, budget, lambda seq_id: None, lambda seq, decoding: ChunkRule(row, sparse=True))


def test_a_step_with_decodes_rounds_block_sparse_chunks_down():
    """Next to decodes the step budget bounds the step's time: a block-sparse chunk ends on the
    row grid below its budget, not the nearer one above it; the first chunk still takes one whole
    row when its budget is smaller, and no later chunk of the step goes past the budget."""
    from sim_device import NoText

    from lserve.engine.sequence import Sequence

    budget = StepBudget(4096, alpha=0.0, itl_slo_s=0.1)
    budget.rate = budget.mixed_rate = 10000.0  # token-equivalents per second
    budget.mixed_rest = 0.0
    sched = _rows_scheduler(budget)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, prefix_cache=False)

    def step() -> list[tuple[str, int]]:
        out = sched.schedule()
        for item in out:  # what the engine's forward does to the sequences
            item.seq.num_computed += item.num_tokens
            if item.seq.num_computed == item.seq.num_tokens:
                item.seq.in_decode = True
                item.seq.append_token(7, NoText(), (), 10**9)
        return [(item.seq.request_id, item.num_tokens) for item in out]

    sched.add(Sequence(0, "d", list(range(10, 42)), params, arrival=0.0))
    assert step() == [("d", 32)]
    for i in (1, 2):
        sched.add(Sequence(i, f"p{i}", [5 + j % 90 for j in range(2000)], params, arrival=float(i)))
    assert step() == [("d", 1), ("p1", 768)]  # 0.09 s of prefill at 10000/s: 900 tokens (the nearer end: 1024)
    budget.mixed_rate = 1000.0  # 90 tokens: below one row
    assert step() == [("d", 1), ("p1", 256)]  # one whole row; p2 does not go past the budget


def test_engine_reports_where_step_time_went():
    """Per step kind the engine sums wall seconds (and the prefill part's, where a step's prefill is
    timed apart: CUDA only), and its stats carry what the step budget has learnt."""
    llm = LLM("tiny", max_batched_tokens=256, step_time_target=0.05)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([[10 + i % 200 for i in range(600)]], params)
    st = llm.stats()
    assert set(st.step_seconds) == set(st.step_kinds) >= {"prefill", "decode_eager"}
    assert all(wall > 0 and part == 0.0 for wall, part in st.step_seconds.values())  # one forward per step here
    assert st.budget["rate"] > 0 and st.budget["decode_s"] > 0 and st.budget["sparse_share"] == 1.0
