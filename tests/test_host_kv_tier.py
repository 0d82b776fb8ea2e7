"""Host KV tier (issue 39) on the torch backend: greedy outputs equal with it on and off while a
tiny resident set forces fetches, evictions and spills every step; prefix-cache hits on offloaded
pages, preemption and abort with every slot accounted for; counters; start-up checks; admission.

Each tier-on engine is compared with a tier-off twin holding as many dense pages as the tier's
virtual pages, so both schedule (and preempt) the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys

import numpy as np
import pytest
import torch

from lserve.config import CacheConfig, ConfigError, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.engine.request_check import CONTEXT_LENGTH_EXCEEDED, RequestError
from lserve.models.loader import load_model

SPARSE = SparsityConfig(pattern="random", static_sparsity=0.5, sink_tokens=16, local_tokens=32, token_budget=48,
                        reuse_interval=2, dynamic_threshold=0)
DOC = " ".join(f"Box {i} is {['red', 'blue', 'green', 'black'][i % 4]}." for i in range(40))
QUESTIONS = [" Q: what colour is box 5? A:", " Q: which box is black? A:", " Q: is box 9 red? A:"]
# 64-token steps, 2 sequences, 16-token pages, a 1 + 3 page window: a step pins 4 + 2 * 5 pages.
PINNED = 14


def _engine(loaded, model: str, num_pages: int, host_kv_gib: float = 0.0, kv_quant: str = "none",
            prefix_cache: bool = True, max_num_seqs: int = 2) -> LLMEngine:
    cc = CacheConfig(page_size=16, logical_page_size=4, num_pages=num_pages, kv_quant=kv_quant, host_kv_gib=host_kv_gib)
    return LLMEngine(EngineConfig(model=model, sparsity=SPARSE, cache=cc, max_num_seqs=max_num_seqs,
                                  max_batched_tokens=64, prefix_cache=prefix_cache), loaded)


def _gib(loaded, model: str, host_pages: int, kv_quant: str = "none") -> float:
    """``host_kv_gib`` that gives ``host_pages`` host pages (page bytes depend on the quantization)."""
    probe = _engine(loaded, model, PINNED, host_kv_gib=0.01, kv_quant=kv_quant)
    return (host_pages + 0.5) * sum(p.page_bytes() for p in probe.cache.dense) / 2**30


def _twin(loaded, model: str, tiered: LLMEngine, **kw) -> LLMEngine:
    """A tier-off engine with as many dense pages as ``tiered`` has virtual ones, chunking prompts
    as it does (with the tier, by the token cap alone: ``StepBudget.for_engine``; other chunk
    boundaries round quantized keys differently)."""
    off = _engine(loaded, model, tiered.cache.dense_alloc.num_pages, **kw)
    assert tiered.scheduler.budget.alpha == 0 < off.scheduler.budget.alpha
    off.scheduler.budget = tiered.scheduler.budget
    return off


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=3)


@pytest.fixture
def mirrored(monkeypatch):
    """Engines built here keep the tier as the cupy backend does (device page table, batched
    copies; kernels read through the table), with every pool on the CPU."""
    from lserve.cache.kv_cache import KVCache
    from lserve.engine import llm_engine

    monkeypatch.setattr(llm_engine, "KVCache", functools.partial(KVCache, host_mirror=True))


def test_greedy_equal_with_fetches_and_prefix_hit_on_offloaded_pages(tiny):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [DOC[:400] + q for q in QUESTIONS[:2]]
    on = _engine(tiny, "tiny", PINNED, host_kv_gib=_gib(tiny, "tiny", 90))
    tier = on.cache.host_tier
    assert on.cache.dense_alloc.num_pages == 90  # admission counts both tiers: 14 resident + 90 host - 14 pinned
    first = on.generate(prompts[:1], greedy)[0]
    # More pages cached than the device holds: the next prompt's hit includes offloaded pages.
    assert on.stats().prefix_cached_pages > PINNED
    second = on.generate(prompts[1:], greedy)[0]
    assert second.metrics["cached_tokens"] >= 16 * 20
    st = on.stats().host_kv
    assert st.spilled > 0 and st.pages_on_host > 0 and st.bytes_d2h > 0
    assert st.misses > 0 and st.fetched > 0 and st.hits > 0 and 0 < st.hit_rate < 1
    assert st.streamed > 0 and st.bytes_h2d > 0  # prefill of the hit read its past from the host
    assert st.resident_slots_used <= st.resident_slots
    tier.check()
    assert len(tier.held_pages()) == on.stats().prefix_cached_pages  # only idle cached pages hold slots
    off = _twin(tiny, "tiny", on)
    assert off.cache.host_tier is None and off.stats().host_kv is None
    assert [o.token_ids for o in off.generate(prompts[:1], greedy) + off.generate(prompts[1:], greedy)] == \
        [first.token_ids, second.token_ids]


@pytest.mark.parametrize("kv_quant", ["none", "int8", "int4"])
def test_preemption_equal_and_every_slot_returned(tiny, kv_quant):
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [DOC[:250] + q for q in QUESTIONS]
    on = _engine(tiny, "tiny", PINNED, host_kv_gib=_gib(tiny, "tiny", 24, kv_quant), kv_quant=kv_quant,
                 prefix_cache=False)
    assert on.cache.dense_alloc.num_pages == 24  # growing sequences of ~20 pages do not fit together
    outs = on.generate(prompts, params)
    assert on.scheduler.num_preemptions > 0
    st = on.stats().host_kv
    assert st.fetched > 0 and st.spilled > 0
    off = _twin(tiny, "tiny", on, kv_quant=kv_quant, prefix_cache=False)
    assert [o.token_ids for o in off.generate(prompts, params)] == [o.token_ids for o in outs]
    assert off.scheduler.num_preemptions == on.scheduler.num_preemptions
    on.cache.host_tier.check()
    assert on.cache.all_free() and on.cache.host_tier.held_pages() == set()
    st = on.stats().host_kv
    assert st.resident_slots_used == 0 and st.pages_on_host == 0


def test_abort_gives_back_every_slot(tiny):
    on = _engine(tiny, "tiny", PINNED, host_kv_gib=0.003, prefix_cache=True)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    rids = [on.add_request(DOC[:300] + q, params) for q in QUESTIONS[:2]]
    while not (on.sequence(rids[0]) and on.sequence(rids[0]).in_decode and on.stats().host_kv.spilled):
        on.step()
    for _ in range(3):
        on.step()
    assert on.abort(rids[0]) and not on.abort(rids[0])
    on.cache.host_tier.check()
    while on.has_unfinished():
        on.step()
    tier = on.cache.host_tier
    tier.check()
    assert on.cache.all_free()
    assert len(tier.held_pages()) == on.stats().prefix_cached_pages
    on.cache.prefix.evict(on.cache.prefix.num_evictable)  # idle cached pages given back: nothing is held
    tier.check()
    assert tier.held_pages() == set() and on.stats().host_kv.pages_on_host == 0


def test_request_past_both_tiers_is_refused(tiny):
    on = _engine(tiny, "tiny", PINNED, host_kv_gib=0.001)
    pages = on.cache.dense_alloc.num_pages
    on.check_request([65] * (16 * pages - 8), SamplingParams(max_tokens=8))  # fits both tiers together
    with pytest.raises(RequestError) as e:
        on.check_request([65] * (16 * pages), SamplingParams(max_tokens=8))
    assert e.value.code == CONTEXT_LENGTH_EXCEEDED


def test_start_up_checks(tiny):
    with pytest.raises(ConfigError, match="pages one step pins"):
        _engine(tiny, "tiny", PINNED - 1, host_kv_gib=0.001)
    with pytest.raises(ConfigError, match="adds no capacity"):
        _engine(tiny, "tiny", PINNED, host_kv_gib=0.00001)
    EngineConfig(backend="cupy", device="cuda", cache=CacheConfig(host_kv_gib=0.001))  # the cupy port: accepted
    with pytest.raises(ConfigError, match="host_kv_gib must be >= 0"):
        CacheConfig(host_kv_gib=-1)


@pytest.mark.parametrize("gib,message", [("100000", "GiB of memory this host has available"),
                                         ("-1", "host_kv_gib must be >= 0")])
def test_cli_refuses_bad_host_kv_gib(gib, message):
    r = subprocess.run([sys.executable, "-m", "lserve", "generate", "hi", "--model", "tiny", "--host-kv-gib", gib],
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("lserve: error:"), r.stderr
    assert message in lines[0]


@pytest.mark.parametrize("kv_quant,prefix_cache", [("none", True), ("int4", False)])
def test_mirrored_tier_keeps_outputs_and_its_device_table(tiny, mirrored, kv_quant, prefix_cache):
    """The cupy backend's bookkeeping on the CPU: copies batched per flush (in an order that keeps
    every read before a later write of its slot), reads through the mirrored slot table, preemption
    and prefix hits on offloaded pages; outputs equal the tier-off twin's, the table the host one's."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [DOC[:250] + q for q in QUESTIONS]
    on = _engine(tiny, "tiny", PINNED, host_kv_gib=_gib(tiny, "tiny", 24, kv_quant), kv_quant=kv_quant,
                 prefix_cache=prefix_cache)
    tier = on.cache.host_tier
    assert tier.mirror and tier.slot_table is not None
    outs = on.generate(prompts, params) + on.generate(prompts[:1], params)
    if prefix_cache:  # the repeated prompt hits pages that went to the host
        assert outs[-1].metrics["cached_tokens"] >= 16 * 10
    else:  # growing sequences that do not fit together
        assert on.scheduler.num_preemptions > 0
    st = on.stats().host_kv
    assert st.fetched > 0 and st.spilled > 0
    tier.check()
    off = _twin(tiny, "tiny", on, kv_quant=kv_quant, prefix_cache=prefix_cache)
    want = off.generate(prompts, params) + off.generate(prompts[:1], params)
    assert [o.token_ids for o in want] == [o.token_ids for o in outs]
    on.cache.prefix.evict(on.cache.prefix.num_evictable)
    tier.check()
    assert tier.held_pages() == set()


def test_bulk_copies_move_the_same_bytes_as_index_copies(tiny, mirrored):
    """The cupy backend moves each flush's pages with one kernel over byte ranges
    (:meth:`HostTier.use_bulk_copy`); the same ranges copied with ``memmove`` on the CPU give the
    tier-off twin's outputs, and every range is a whole page of one storage tensor."""
    import ctypes

    batches = []

    def memmove(ranges):
        batches.append(ranges.copy())
        for src, dst, words in ranges.T.tolist():
            ctypes.memmove(dst, src, words * 16)

    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [DOC[:250] + q for q in QUESTIONS]
    on = _engine(tiny, "tiny", PINNED, host_kv_gib=_gib(tiny, "tiny", 24, "int4"), kv_quant="int4")
    tier = on.cache.host_tier
    tier.use_bulk_copy(memmove)
    outs = on.generate(prompts, params)
    st = on.stats().host_kv
    assert st.fetched > 0 and st.spilled > 0 and batches
    pages = {t[0].numel() * t.element_size() // 16 for layer in tier.resident for t in layer.tensors()} - {0}
    ranges = np.concatenate(batches, axis=1)
    assert set(ranges[2].tolist()) == pages and ranges.shape[1] % 6 == 0  # INT4: 6 tensors a page
    for batch in batches:  # a batch writes each range once
        assert len(set(batch[1].tolist())) == batch.shape[1]
    tier.check()
    off = _twin(tiny, "tiny", on, kv_quant="int4")
    assert [o.token_ids for o in off.generate(prompts, params)] == [o.token_ids for o in outs]


def test_bulk_copy_needs_mirror_and_whole_16_byte_pages():
    from lserve.cache.host_tier import HostTier
    from lserve.cache.paged_pool import PagedPool

    def tier(page_size: int, mirror: bool) -> HostTier:
        pool = lambda n: PagedPool(n, 1, page_size, 2, "int4", torch.float32, "cpu")  # noqa: E731
        return HostTier([pool(4)], [pool(8)], 12, page_size, 0, 1, mirror=mirror)

    with pytest.raises(ValueError, match="mirror"):
        tier(16, False).use_bulk_copy(print)
    with pytest.raises(ValueError, match="16-byte"):
        tier(2, True).use_bulk_copy(print)  # a page of INT4 codes is 2 bytes
    tier(16, True).use_bulk_copy(print)


def _picks_over_offloaded(tiny, reads: int, budget_s: float, resident: int = PINNED, doc: int = 400):
    """A mirrored tier with offloaded pages, a ``TierPicks`` over it, and a selection maker: every
    layer's heads picking the given pages."""
    from lserve.attention.cupy_tier import TierPicks

    on = _engine(tiny, "tiny", resident, host_kv_gib=_gib(tiny, "tiny", 40))
    on.generate([DOC[:doc]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    tier = on.cache.host_tier
    L = tier.num_layers
    nd = [p.num_heads for p in tier.resident]
    offloaded = [v for v in sorted(tier.held_pages()) if not any(tier.is_resident(i, v) for i in range(L))]
    assert len(offloaded) >= 4 and L >= 2
    picks = TierPicks(tier, [(n, True, 0) for n in nd], reads=reads, budget_s=budget_s)

    def selection(pages: list[int]):
        sel = torch.tensor(pages, dtype=torch.int32).expand(L, 1, max(nd), len(pages)).contiguous()
        return sel, torch.full((L, 1, max(nd)), len(pages), dtype=torch.int32), [0], [[0]]

    def resident(v: int) -> list[bool]:  # per layer with dense heads
        return [tier.is_resident(i, v) for i in range(L) if nd[i]]

    return tier, picks, offloaded, selection, resident, nd


def test_a_selections_fetch_is_spread_over_the_reuse_interval(tiny, mirrored):
    """The cupy backend's plan-time fetch (``TierPicks``) installs a selection's picks
    ceil(layers / reuse interval) layers a step, so its host time overlaps the GPU's steps
    instead of lengthening one; the next selection starts where this one ended."""
    tier, picks, off, selection, resident, nd = _picks_over_offloaded(tiny, reads=2, budget_s=1.0)
    L = tier.num_layers
    assert picks.layers_per_step == -(-L // 2)
    picks.queue(*selection(off[:2]))
    picks.advance()  # the first share of the layers
    half = picks.layers_per_step
    assert all(tier.is_resident(i, off[0]) for i in range(half) if nd[i])
    assert not any(tier.is_resident(i, off[0]) for i in range(half, L))
    picks.advance()  # the rest: every layer
    assert all(resident(off[0])) and all(resident(off[1]))
    picks.advance()  # nothing queued: nothing happens
    assert tier.stats().fetch_layers_skipped == 0
    tier.check()


def test_a_fetch_over_its_host_budget_is_superseded_and_rotates_layers(tiny, mirrored):
    """With no host time to spare a step fetches one layer; a selection not done when the next
    arrives is skipped (counted), and the next starts at the following layer, so every layer is
    fetched in turn."""
    tier, picks, off, selection, resident, nd = _picks_over_offloaded(tiny, reads=4, budget_s=0.0)
    L = tier.num_layers
    picks.queue(*selection([off[0]]))
    picks.advance()  # layer 0 only
    assert tier.is_resident(0, off[0]) == bool(nd[0]) and not any(tier.is_resident(i, off[0]) for i in range(1, L))
    picks.queue(*selection([off[1]]))  # supersedes the first: its other L - 1 layers are skipped
    assert tier.stats().fetch_layers_skipped == L - 1
    for _ in range(L):
        picks.advance()
    assert all(resident(off[1]))  # layers 1..L-1, then 0
    assert not any(tier.is_resident(i, off[0]) for i in range(1, L))
    tier.check()


def test_with_a_staging_area_only_repeated_misses_are_installed(tiny, monkeypatch):
    """A staged pick crosses the link once a selection whatever the steps that read it, so a
    selection's misses enter the resident set only when the selection before missed them too,
    even when every head picked them (without staging those enter at once: the test above)."""
    from lserve.cache.kv_cache import KVCache
    from lserve.engine import llm_engine

    monkeypatch.setattr(llm_engine, "KVCache", functools.partial(KVCache, host_mirror=True))
    monkeypatch.setattr(llm_engine, "tier_stage_entries", lambda *_: 2)  # as on the cupy backend
    tier, picks, off, selection, resident, nd = _picks_over_offloaded(tiny, reads=4, budget_s=1.0,
                                                                     resident=PINNED + 8, doc=1200)
    assert tier.stage_slots > 0 and picks.admit_reads == 1 and picks.reads == 4
    picks.apply(*selection(off[:2]))
    assert not any(resident(off[0])) and not any(resident(off[1]))
    assert tier.stats().deferred == 2 * sum(1 for n in nd if n)
    picks.apply(*selection(off[1:3]))  # off[1] missed twice: it enters; off[2] waits
    assert all(resident(off[1])) and not any(resident(off[2]))
    tier.check()


def test_mirrored_fetch_of_stale_picks_counts_streamed_reads(tiny, mirrored):
    """Picks fetched after their step (the cupy backend's plan-time fetch): misses count as
    streamed reads, pages freed since are skipped, and the table follows."""
    on = _engine(tiny, "tiny", PINNED, host_kv_gib=_gib(tiny, "tiny", 40))
    on.generate([DOC[:400]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    tier = on.cache.host_tier
    cached = sorted(tier.held_pages())
    offloaded = [v for v in cached if not tier.is_resident(0, v)]
    assert offloaded
    free = next(v for v in range(on.cache.dense_alloc.num_pages) if v not in cached)
    before = tier.stats()
    tier.fetch(0, np.array(offloaded[:2] + [free]), streamed=True)
    st = tier.stats()
    assert st.misses - before.misses == 2 and st.streamed - before.streamed == 2
    assert all(tier.is_resident(0, v) for v in offloaded[:2]) and not tier.is_resident(0, free)
    tier.check()


def test_fetches_of_every_layer_flushed_once_equal_flushed_each(tiny, mirrored):
    """The cupy backend fetches a selection's picks layer by layer and flushes once: the resident
    pools and the device table end as if each fetch had flushed its own copies."""
    def run(each: bool):
        on = _engine(tiny, "tiny", PINNED, host_kv_gib=_gib(tiny, "tiny", 40))
        on.generate([DOC[:400]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        tier = on.cache.host_tier
        offloaded = [v for v in sorted(tier.held_pages()) if not tier.is_resident(0, v)]
        assert len(offloaded) >= 3
        for layer in range(tier.num_layers):
            tier.fetch(layer, np.array(offloaded[:3]), streamed=True, flush=each)
        tier.flush()
        tier.check()
        return ([t.clone() for layer in range(tier.num_layers) for t in tier.resident[layer].tensors()],
                tier.slot_table.clone(), [tier.is_resident(layer, v) for layer in range(tier.num_layers)
                                          for v in offloaded[:3]])

    pools_a, table_a, res_a = run(True)
    pools_b, table_b, res_b = run(False)
    assert all(res_a) and res_a == res_b
    assert torch.equal(table_a, table_b)
    assert all(torch.equal(x, y) for x, y in zip(pools_a, pools_b))


def test_streamed_picks_cost_the_picking_heads_parts_and_repeats_enter(tiny, mirrored, monkeypatch):
    """A decode kernel reads only its own head's part of a page on the host: misses picked by
    one head cost one part each, a page picked by every head the whole page. Pages picked by two
    or more heads enter the resident set at once, those one head picked when picked again."""
    from lserve.cache import tier_policy

    dense = dataclasses.replace(SPARSE, static_sparsity=0.0)  # both of tiny's KV heads dense: 2 parts a page
    cc = CacheConfig(page_size=16, logical_page_size=4, num_pages=PINNED, host_kv_gib=_gib(tiny, "tiny", 80))
    on = LLMEngine(EngineConfig(model="tiny", sparsity=dense, cache=cc, max_num_seqs=2, max_batched_tokens=64), tiny)
    on.generate([DOC[:400]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    tier = on.cache.host_tier
    pool = on.cache.dense[0]
    assert pool.num_heads == 2
    offloaded = [v for v in sorted(tier.held_pages()) if not tier.is_resident(0, v)]
    assert len(offloaded) >= 4
    a, b, c, d = offloaded[:4]
    part = pool.page_bytes() // pool.num_heads

    def fetch(pages, heads):  # a selection read by 2 steps: installing pays for pages both heads picked
        before = tier.stats()
        tier.fetch(0, np.array(pages), streamed=True, heads=np.array(heads), reads=2)
        st = tier.stats()
        installs = (st.fetched - before.fetched) * pool.page_bytes()  # whole pages copied in
        return st.bytes_h2d - before.bytes_h2d - installs, st.misses - before.misses, st.deferred - before.deferred

    # head 0 picks a and b, head 1 picks b, both pick c: 1 + 2 + 2 parts read
    assert fetch([a, b, b, c, c], [0, 0, 1, 0, 1]) == (5 * part, 3, 1)
    assert not tier.is_resident(0, a) and tier.is_resident(0, b) and tier.is_resident(0, c)
    assert fetch([a], [1]) == (part, 1, 0) and tier.is_resident(0, a)  # picked again: it enters
    assert fetch([a], [0]) == (0, 0, 0)  # a hit
    monkeypatch.setattr(tier_policy, "ADMIT_ON_REPEAT", False)
    assert fetch([d], [0]) == (part, 1, 0) and tier.is_resident(0, d)  # the switch off: every miss enters
    tier.check()


# -- long prompts: a prompt many times the resident set, prefilled in chunks ----------------------
RESIDENT = 32  # resident pages (512 tokens); the long prompt is 8x that


def _long_prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 200, n).tolist()


def _record_scans(tier) -> list[tuple]:
    """Wrap ``tier.scan``: every scan's (layer, pages, host pages, runs, prefill), in order."""
    seen, scan = [], tier.scan

    def recording(layer, pages, prefill=False):
        sc = scan(layer, pages, prefill)
        seen.append((layer, len(pages), len(sc.host_pos), len(sc.runs), prefill))
        return sc

    tier.scan = recording
    return seen


def test_long_prompt_reads_its_past_in_bulk_with_full_chunks(tiny):
    """A 4096-token prompt over 512 resident tokens: chunks carry max_batched_tokens at any depth,
    each chunk finds as much of its past resident as the set holds beside a step's pins, reads the
    rest in one or two bulk copies per layer, and the counters add up; outputs equal the twin's."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = _long_prompt(8 * RESIDENT * 16, 0)
    on = _engine(tiny, "tiny", RESIDENT, host_kv_gib=_gib(tiny, "tiny", 300))
    tier = on.cache.host_tier
    scans = _record_scans(tier)
    out = on.generate([prompt], params)[0]
    pre = [s for s in scans if s[4]]
    layers = {s[0] for s in pre}
    assert len(pre) == len(layers) * (len(prompt) // 64 - 1)  # 64-token chunks to the end
    for layer, n, host, runs, _ in pre:
        assert n - host >= min(n, RESIDENT - PINNED), (layer, n, host)  # the past stays resident as room allows
        assert runs <= 2 and (runs > 0) == (host > 0)
    st = on.stats().host_kv
    page_bytes = [p.page_bytes() for p in on.cache.dense]
    assert st.prefill_streamed == sum(s[2] for s in pre) > 4 * len(prompt) // 16
    assert st.prefill_bytes_h2d == sum(s[2] * page_bytes[s[0]] for s in pre)
    assert st.h2d_copies == sum(s[3] for s in scans) < st.streamed / 20
    assert st.streamed >= st.prefill_streamed and st.bytes_h2d >= st.prefill_bytes_h2d
    tier.check()
    off = _twin(tiny, "tiny", on)
    assert off.generate([prompt], params)[0].token_ids == out.token_ids


def test_long_prompts_with_prefix_hits_and_preemption_keep_outputs(tiny):
    """Long prompts several times the resident set, chunked: one with a short one decoding beside
    it, then one whose long prefix hits pages that went to the host next to another long one, with
    fewer virtual pages than those two need (preemption): outputs equal the twin's, every slot
    comes back."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    shared = _long_prompt(4 * RESIDENT * 16, 1)
    first = [shared + _long_prompt(300, 2), DOC[:200]]
    second = [shared + _long_prompt(300, 3), _long_prompt(len(shared) + 300, 4)]
    on = _engine(tiny, "tiny", RESIDENT, host_kv_gib=_gib(tiny, "tiny", 200))
    assert on.cache.dense_alloc.num_pages < 2 * len(second[0]) // 16  # the second two do not fit together
    # the first of the second two decodes while the other prefills (one prompt per 64-token step)
    plist = [SamplingParams(max_tokens=80, temperature=0, ignore_eos=True), params]
    outs = on.generate(first, params) + on.generate(second, plist)
    assert outs[2].metrics["cached_tokens"] >= len(shared) - 16
    assert on.scheduler.num_preemptions > 0
    st = on.stats().host_kv
    assert st.prefill_streamed > 0 and st.fetched > 0 and st.hits > 0
    on.cache.host_tier.check()
    off = _twin(tiny, "tiny", on)
    want = off.generate(first, params) + off.generate(second, plist)
    assert [o.token_ids for o in want] == [o.token_ids for o in outs]
    assert off.scheduler.num_preemptions == on.scheduler.num_preemptions
    on.cache.prefix.evict(on.cache.prefix.num_evictable)
    on.cache.host_tier.check()
    assert on.cache.host_tier.held_pages() == set()


def test_policy_evicts_unprotected_pages_first():
    from lserve.cache.tier_policy import RecencyPolicy

    pol = RecencyPolicy()
    pol.touch([1, 2, 3])
    pol.touch([10, 11], protect=True)  # a prefilling sequence's fresh pages
    pol.protect([2])
    pol.touch([1])
    assert [pol.victim(lambda p, k=k: p not in k) for k in ((), {3}, {1, 3}, {1, 3, 10})] == [3, 1, 10, 11]
    pol.unprotect([10, 2])  # its prefill ended: most recent among the others
    assert pol.victim(lambda p: p not in {3, 1}) == 10 and len(pol) == 5
    pol.forget(11)
    pol.forget(3)
    assert 11 not in pol and 3 not in pol and len(pol) == 3


def test_admission_weighs_heads_and_reads_against_the_whole_page():
    from lserve.cache.tier_policy import RepeatAdmission

    miss = np.array([3, 5, 8])
    adm = RepeatAdmission()
    # 4 dense heads, a selection read by 4 steps: a page enters when 2+ heads picked it
    assert adm.admit(miss, np.array([1, 2, 4]), n_heads=4, reads=4).tolist() == [False, True, True]
    # the next selection misses 3 again (left on the host last time): it enters now; 9 is new
    assert adm.admit(np.array([3, 9]), np.array([1, 1]), n_heads=4, reads=4).tolist() == [True, False]
    # one dense head: the whole page is the head's part, so any pick read twice or more enters
    assert RepeatAdmission().admit(miss, np.array([1, 1, 1]), n_heads=1, reads=2).all()
    # a selection read once: only repeats enter
    once = RepeatAdmission()
    assert not once.admit(miss, np.array([4, 4, 4]), n_heads=4, reads=1).any()
    assert once.admit(miss, np.array([1, 1, 1]), n_heads=4, reads=1).all()


# -- the eviction policy's search: hot pages (no host copy) are never walked ------------------------
def test_policy_keeps_hot_pages_out_of_the_clean_search():
    from lserve.cache.tier_policy import RecencyPolicy

    pol = RecencyPolicy()
    pol.touch([1, 2, 3], hot=True)  # written this step: no host copy
    pol.touch([4, 5])  # installed from the host
    pol.touch([6], protect=True, hot=True)
    pol.touch([7], protect=True)
    assert list(pol.candidates()) == [4, 5, 7] and list(pol.candidates(hot=True)) == [1, 2, 3, 6]
    seen = []
    assert pol.victim(lambda p: seen.append(p) or p != 4) == 5 and seen == [4, 5]  # 1-3 not looked at
    pol.set_hot(2, False)  # spilled: the most recent clean page
    pol.set_hot(5, True)  # written again: its host copy dropped
    pol.protect([2])  # a page keeps its state across protection
    assert list(pol.candidates()) == [4, 7, 2] and list(pol.candidates(hot=True)) == [1, 3, 5, 6]
    assert pol.victim(lambda p: p != 1, hot=True) == 3  # the spill fallback's search
    pol.unprotect([6, 2])
    assert list(pol.candidates()) == [4, 2, 7] and list(pol.candidates(hot=True)) == [1, 3, 5, 6]
    pol.forget(4)
    assert 4 not in pol and len(pol) == 6


def test_pinned_pages_leave_the_search_and_come_back_most_recent():
    from lserve.cache.tier_policy import RecencyPolicy

    pol = RecencyPolicy()
    pol.touch([1, 2, 3])
    pol.touch([4], hot=True)
    pol.pin([1, 4, 99])  # 99 is not held: skipped
    assert list(pol.candidates()) == [2, 3] and list(pol.candidates(hot=True)) == [] and len(pol) == 4
    pol.touch([1])  # no position while pinned, but its state follows the tier
    pol.set_hot(4, False)
    pol.protect([1])
    assert pol.pages(hot=False) == {1, 2, 3, 4} and pol.pages(hot=True) == set()
    pol.unpin([4, 1])
    assert list(pol.candidates()) == [2, 3, 4, 1]  # 1 among the protected ones
    pol.pin([3])
    pol.forget(3)
    assert 3 not in pol and list(pol.candidates()) == [2, 4, 1]


def test_a_decode_step_pins_only_the_pages_that_changed():
    """Two sequences decoding: each step's written pages, sinks and windows are out of every
    layer's victim search, and the policy moves only the pages that entered the pinned set
    (touching all of them each step cost ~7 ms a step at 16 x 128k); a page that leaves a window
    comes back as the most recent."""
    from lserve.cache.host_tier import HostTier, SeqSpan
    from lserve.cache.paged_pool import PagedPool
    from lserve.cache.tier_policy import RecencyPolicy

    policies, pinned_per_call = [], []

    class Recording(RecencyPolicy):
        def __init__(self):
            super().__init__()
            policies.append(self)

        def pin(self, pages):
            pages = list(pages)
            pinned_per_call.append(len(pages))
            super().pin(pages)

    page, window = 4, 2
    pool = lambda n: PagedPool(n, 1, page, 1, "none", torch.float32, "cpu")  # noqa: E731
    tier = HostTier([pool(12) for _ in range(2)], [pool(60) for _ in range(2)], 40, page, 1, window, policy=Recording)
    pages, length, left_seen = [list(range(20)), list(range(20, 40))], [0, 0], 0
    for step in range(40):
        n = 16 if step == 0 else 1
        spans = [SeqSpan(i, pages[i], length[i], length[i] + n, step > 0) for i in range(2)]
        length = [x + n for x in length]
        pinned_per_call.clear()
        tier.prepare(spans)
        pinned = set()
        for s in spans:
            last = (s.length - 1) // page
            pinned |= set(s.pages[s.start // page: last + 1])
            if s.decode:
                pinned |= {s.pages[0], *s.pages[last - window + 1: last + 1]}
        for pol in policies:
            assert not pinned & (set(pol.candidates()) | set(pol.candidates(hot=True)))
        if step:
            assert len(pinned_per_call) == 2 and max(pinned_per_call) <= 2  # a new page a sequence at most
        last = (length[0] - 1) // page
        if step > page and (length[0] - 1) % page == 0:  # both moved to a new page
            gone = {p[last - window] for p in pages}
            assert all(set(list(pol.candidates())[-2:]) == gone for pol in policies)
            left_seen += 1
    assert left_seen >= 5
    tier.check()


class _CountingPolicy:
    """Makes :class:`RecencyPolicy` objects that record each victim search: (predicate calls,
    found a page, hot search)."""

    def __init__(self) -> None:
        self.searches: list[tuple[int, bool, bool]] = []

    def __call__(self):
        from lserve.cache.tier_policy import RecencyPolicy

        searches = self.searches

        class Counting(RecencyPolicy):
            def victim(self, evictable, *args, **kwargs):
                n = 0

                def counted(p):
                    nonlocal n
                    n += 1
                    return evictable(p)
                v = super().victim(counted, *args, **kwargs)
                searches.append((n, v is not None, kwargs.get("hot", False)))
                return v

            def victims(self, k, evictable):
                n = 0

                def counted(p):
                    nonlocal n
                    n += 1
                    return evictable(p)
                vs = super().victims(k, counted)
                searches.append((n, len(vs), k))
                return vs
        return Counting()


def _drive_tier(resident: int, host: int, seqs: int, prompt: int, budget: int, decode_steps: int, picks: int,
                page: int = 16, layers: int = 2, seed: int = 0):
    """A tier over tiny CPU pools (1 head, head_dim 1; no sink, a 1-page window) that ``seqs``
    sequences of ``prompt`` tokens prefill in turn, one chunk a step beside the ones decoding, then
    decode ``decode_steps`` more steps; every other step fetches ``picks`` random pages per decoder
    into each layer. Each written page holds ``1000 * layer + page + 1``, checked wherever it is
    at the end. Returns the tier, its policy recorder and, per fetch, (installs, its victim
    searches, hot pages before it)."""
    from lserve.cache.host_tier import HostTier, SeqSpan, pinned_bound
    from lserve.cache.paged_pool import PagedPool

    rng = np.random.default_rng(seed)
    pool = lambda n: PagedPool(n, 1, page, 1, "none", torch.float32, "cpu")  # noqa: E731
    rec = _CountingPolicy()
    virtual = resident + host - pinned_bound(budget, seqs, page, 0, 1)
    tier = HostTier([pool(resident) for _ in range(layers)], [pool(host) for _ in range(layers)], virtual, page, 0, 1,
                    policy=rec)
    pages: list[list[int]] = [[] for _ in range(seqs)]
    length, fresh, fetches, step = [0] * seqs, iter(range(virtual)), [], 0
    while decode_steps:
        dec = [i for i in range(seqs) if length[i] >= prompt]
        pre = [i for i in range(seqs) if length[i] < prompt][:1]
        spans = []
        for i in dec + pre:
            n = 1 if i in dec else min(budget - len(dec), prompt - length[i])
            while len(pages[i]) * page < length[i] + n:
                pages[i].append(next(fresh))
            spans.append(SeqSpan(i, pages[i], length[i], length[i] + n, i in dec))
            length[i] += n
        tier.prepare(spans)
        for s in spans:  # the step writes its tokens' pages
            w = torch.tensor(s.pages[s.start // page: (s.length - 1) // page + 1])
            for layer in range(layers):
                tier.resident[layer].k[tier.resident_slots(layer, w)] = (1000 * layer + w + 1).float()[:, None, None, None]
        if dec and step % 2 == 0:
            for layer in range(layers):
                want = np.concatenate([np.asarray(pages[i])[rng.choice((length[i] - 1) // page, picks, replace=False)]
                                       for i in dec])
                before, n = tier.stats(), len(rec.searches)
                tier.fetch(layer, want)
                fetches.append((tier.stats().fetched - before.fetched, rec.searches[n:], before.hot_pages))
        decode_steps -= not pre
        step += 1
    tier.check()
    ids = torch.tensor([v for p in pages for v in p])
    for layer in range(layers):
        r, h, on = tier.locate(layer, ids)
        got = torch.where(on, tier.resident[layer].k[r, 0, 0, 0], tier.host[layer].k[h, 0, 0, 0])
        assert torch.equal(got, (1000 * layer + ids + 1).float()), f"layer {layer}: a page's data is wrong"
    return tier, rec, fetches


def test_victim_search_never_walks_hot_pages():
    """A full host and 44 of 60 resident pages hot (the H100 concurrency run that decoded at 10 s
    a step, scaled down): a fetch's victim search is one walk for all its installs, over the clean
    pages only, never the hot ones at the front of the recency order. Every page's data stays where the table says."""
    tier, rec, fetches = _drive_tier(resident=60, host=100, seqs=4, prompt=544, budget=64, decode_steps=8, picks=8)
    st = tier.stats()
    assert st.pages_on_host == st.host_pages and st.hot_pages >= 40  # full host, resident set mostly hot
    assert sum(n for n, _, _ in fetches) > 200
    for n, searches, hot in fetches:
        assert len(searches) <= 1  # one walk a fetch (none where free slots were enough)
        for calls, found, _ in searches:
            assert found <= n and calls <= 60 - hot  # the clean pages at most, never the hot ones


def test_hot_page_spilled_when_no_clean_victim_is_left():
    """Prefill chunks bigger than the clean resident pages: pinning the next chunk finds no clean
    victim and spills the previous chunk's hot (protected) pages on demand; data stays exact."""
    tier, rec, _ = _drive_tier(resident=6, host=40, seqs=1, prompt=300, budget=64, decode_steps=4, picks=4)
    assert any(ok and hot for _, ok, hot in rec.searches)  # the fallback ran
    assert tier.stats().spilled > 0


def test_staging_area_is_set_aside_from_the_resident_set(tiny, monkeypatch):
    """A mirrored tier with a staging area (the cupy backend's; on the CPU the torch backend reads
    host pages where they are): its slots come off the top of every layer's resident pool and out of
    the virtual page count, no page is ever given one, and outputs equal the tier-off twin's."""
    from lserve.cache.host_tier import HostTier, stage_entries, stage_slots
    from lserve.cache.kv_cache import KVCache
    from lserve.engine import llm_engine

    entries = stage_entries(SPARSE.token_budget, 16)
    assert entries == 2 and stage_slots(PINNED + 16, PINNED, 2, entries) == 2
    assert stage_slots(PINNED + 7, PINNED, 2, entries) == 0 and stage_slots(PINNED + 99, PINNED, 2, 0) == 0
    monkeypatch.setattr(llm_engine, "KVCache", functools.partial(KVCache, host_mirror=True))
    monkeypatch.setattr(llm_engine, "tier_stage_entries", lambda *_: entries)  # as on the cupy backend
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [DOC[:700] + q for q in QUESTIONS]
    gib = _gib(tiny, "tiny", 80)
    on = _engine(tiny, "tiny", PINNED + 16, host_kv_gib=gib)
    tier = on.cache.host_tier
    assert (tier.stage_slots, tier.num_slots, tier.stage_base) == (2, PINNED + 12, PINNED + 12)
    host_pages = tier.host[0].num_pages
    assert on.cache.dense_alloc.num_pages == PINNED + 12 + host_pages - PINNED
    assert on.stats().host_kv.resident_slots == (PINNED + 12) * tiny.config.num_layers
    outs = []
    for p in prompts:  # one at a time and then together: pages cross both ways
        outs += on.generate([p], params)
    outs += on.generate(prompts, params)
    st = on.stats().host_kv
    assert st.spilled > 0 and st.misses > 0, st
    tier.check()
    assert tier.slot_table.max().item() < tier.stage_base  # no resident entry points into the area
    off = _twin(tiny, "tiny", on)
    want = []
    for p in prompts:
        want += off.generate([p], params)
    want += off.generate(prompts, params)
    assert [o.token_ids for o in want] == [o.token_ids for o in outs]
    with pytest.raises(ValueError, match="staging area"):
        HostTier(tier.resident, tier.host, 10, 16, 1, 3, mirror=False, stage_slots=1, stage_entries=2)


def test_staged_parts_count_into_the_h2d_bytes_once(tiny, mirrored):
    """With the staging kernel's counter (the cupy backend's), a snapshot adds the parts it staged
    and their bytes, and a fetch's missed picks count as streamed pages without bytes of their own
    (the staged copy is their one crossing)."""
    on = _engine(tiny, "tiny", PINNED, host_kv_gib=_gib(tiny, "tiny", 40))
    on.generate([DOC[:400]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    tier = on.cache.host_tier
    offloaded = [v for v in sorted(tier.held_pages()) if not tier.is_resident(0, v)]
    assert len(offloaded) >= 2
    head = [p.page_bytes() // max(p.num_heads, 1) for p in tier.resident]
    dense = [i for i, p in enumerate(tier.resident) if p.num_heads]
    assert dense[0] == 0 and len(dense) >= 2
    before = tier.stats()
    tier.fetch(0, np.array(offloaded[:1]), streamed=True, heads=np.array([0]))
    plain = tier.stats()
    assert plain.bytes_h2d - before.bytes_h2d >= head[0]  # in place: its part counted at fetch
    counter = torch.zeros(tier.num_layers, dtype=torch.int64)
    tier.count_staged_by(counter)
    counter[0], counter[dense[-1]] = 5, 2  # parts the kernel staged
    mid = tier.stats()
    assert mid.staged_parts == 7 and mid.bytes_h2d - plain.bytes_h2d == 5 * head[0] + 2 * head[dense[-1]]
    tier.fetch(0, np.array(offloaded[1:2]), streamed=True, heads=np.array([0]))
    after = tier.stats()
    assert after.streamed - mid.streamed == 1 and after.misses - mid.misses == 1
    installed = after.fetched - mid.fetched  # an admitted miss is copied whole; a deferred one adds nothing
    assert after.bytes_h2d - mid.bytes_h2d == installed * tier.resident[0].page_bytes()
