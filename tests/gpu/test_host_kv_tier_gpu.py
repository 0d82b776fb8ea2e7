"""Host KV tier on the GPU: the torch backend (resident set on the GPU, host pool in CPU memory) and
the cupy backend (host pool in mapped pinned memory, kernels reading through the tier's device
table, CUDA graphs): greedy outputs equal with the tier on and off while pages cross every step."""

from __future__ import annotations

import pytest
import torch

from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.models.loader import load_model

SPARSE = SparsityConfig(pattern="random", static_sparsity=0.5, sink_tokens=16, local_tokens=32, token_budget=48,
                        reuse_interval=2, dynamic_threshold=0)
DOC = " ".join(f"Box {i} is {['red', 'blue', 'green', 'black'][i % 4]}." for i in range(40))


def _engine(loaded, num_pages: int, gib: float, kv_quant: str) -> LLMEngine:
    cc = CacheConfig(page_size=16, logical_page_size=4, num_pages=num_pages, kv_quant=kv_quant, host_kv_gib=gib)
    return LLMEngine(EngineConfig(model="tiny", sparsity=SPARSE, cache=cc, device="cuda", dtype="float32",
                                  max_num_seqs=2, max_batched_tokens=64, backend="torch"), loaded)


def _chunked_as(off: LLMEngine, on: LLMEngine) -> LLMEngine:
    """``off`` (tier off) chunking prompts as ``on`` (tier on: by the token cap alone,
    ``StepBudget.for_engine``); other chunk boundaries round keys differently."""
    off.scheduler.budget = on.scheduler.budget
    return off


def test_host_tier_across_devices_keeps_greedy_outputs():
    tiny = load_model("tiny", seed=3, device="cuda", dtype=torch.float32)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [DOC[:400] + q for q in (" Q: box 5? A:", " Q: which box is black? A:")]
    for kv_quant in ("none", "int4"):
        on = _engine(tiny, 14, 0.004, kv_quant)
        assert on.cache.host_tier.host[0].k.device.type == "cpu" and on.cache.dense[0].resident.k.is_cuda
        outs = on.generate(prompts, params)
        st = on.stats().host_kv
        assert st.fetched > 0 and st.spilled > 0 and st.streamed > 0
        on.cache.host_tier.check()
        off = _chunked_as(_engine(tiny, on.cache.dense_alloc.num_pages, 0.0, kv_quant), on)
        assert [o.token_ids for o in off.generate(prompts, params)] == [o.token_ids for o in outs]


# -- the cupy backend (kernels read dense pages through the tier's device table) -----------------
def _cupy(loaded, num_pages: int, gib: float, kv_quant: str, graphs: bool, prefix_cache: bool = True,
          dtype: str = "bfloat16") -> LLMEngine:
    cc = CacheConfig(page_size=16, logical_page_size=4, num_pages=num_pages, kv_quant=kv_quant, host_kv_gib=gib)
    return LLMEngine(EngineConfig(model="tiny", sparsity=SPARSE, cache=cc, device="cuda", dtype=dtype,
                                  max_num_seqs=2, max_batched_tokens=64, backend="cupy", cuda_graphs=graphs,
                                  prefix_cache=prefix_cache), loaded)


def _cupy_gib(loaded, host_pages: int, kv_quant: str) -> float:
    probe = _cupy(loaded, 14, 0.01, kv_quant, False)
    return (host_pages + 0.5) * sum(p.page_bytes() for p in probe.cache.dense) / 2**30


def test_cupy_tier_uses_mapped_host_pools_and_kernels_through_its_table():
    tiny = load_model("tiny", seed=3, device="cuda", dtype=torch.bfloat16)
    on = _cupy(tiny, 14, 0.004, "none", False)
    tier = on.cache.host_tier
    assert tier.mirror and tier.slot_table.is_cuda
    assert tier.host[0].k.is_cuda and on.backend.tier is tier  # host memory, addressed by the GPU
    out = on.generate([DOC[:300]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and on.stats().host_kv.spilled > 0


@pytest.mark.parametrize("kv_quant,graphs", [("none", False), ("none", True), ("int8", True), ("int4", True)])
def test_cupy_tier_greedy_equal_with_fetches_every_step(kv_quant, graphs):
    """A resident set of the pinned bound (14 pages) with ~90 virtual ones: every selecting step
    reads most picks from the host and the next steps fetch them; prefix hits on offloaded pages
    (second generate) and preemption (three growing sequences); outputs equal tier-off."""
    tiny = load_model("tiny", seed=3, device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = [DOC[:400] + q for q in (" Q: box 5? A:", " Q: which box is black? A:", " Q: is box 9 red? A:")]
    on = _cupy(tiny, 14, _cupy_gib(tiny, 40, kv_quant), kv_quant, graphs)
    outs = on.generate(prompts, params) + on.generate(prompts[:1], params)
    st = on.stats().host_kv
    assert st.spilled > 0 and st.pages_on_host > 0 and st.misses > 0 and st.fetched > 0 and st.streamed > 0
    assert st.bytes_h2d > 0 and st.bytes_d2h > 0
    assert outs[-1].metrics["cached_tokens"] >= 16 * 20  # the repeat hit pages that went to the host
    if graphs:  # decode steps replayed: the kernels read the table and host pool at fixed addresses
        assert on.graphs.replays > 0
    on.cache.host_tier.check()  # the device table equals the host one
    off = _chunked_as(_cupy(tiny, on.cache.dense_alloc.num_pages, 0.0, kv_quant, graphs), on)
    want = off.generate(prompts, params) + off.generate(prompts[:1], params)
    assert [o.token_ids for o in want] == [o.token_ids for o in outs]


def test_cupy_tier_preemption_returns_every_slot():
    tiny = load_model("tiny", seed=3, device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [DOC[:250] + q for q in (" Q: box 5? A:", " Q: which box is black? A:", " Q: is box 9 red? A:")]
    on = _cupy(tiny, 14, _cupy_gib(tiny, 24, "int4"), "int4", True, prefix_cache=False)
    outs = on.generate(prompts, params)
    assert on.scheduler.num_preemptions > 0
    off = _chunked_as(_cupy(tiny, on.cache.dense_alloc.num_pages, 0.0, "int4", True, prefix_cache=False), on)
    assert [o.token_ids for o in off.generate(prompts, params)] == [o.token_ids for o in outs]
    tier = on.cache.host_tier
    tier.check()
    assert on.cache.all_free() and tier.held_pages() == set()


@pytest.mark.parametrize("kv_quant", ["none", "int4"])
def test_cupy_long_prompt_stages_its_past_in_bulk(kv_quant):
    """A prompt 8x the resident set (32 pages), chunked: each chunk's offloaded past comes from the
    mapped host pool's CPU twin in a copy or two per layer (a DMA, not reads of mapped memory), and
    what is staged equals what the kernels read there; outputs equal tier-off with the same chunks."""
    import numpy as np

    tiny = load_model("tiny", seed=3, device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = np.random.default_rng(0).integers(10, 200, 8 * 32 * 16).tolist()
    on = _cupy(tiny, 32, _cupy_gib(tiny, 300, kv_quant), kv_quant, True)
    out = on.generate([prompt], params)[0]
    st = on.stats().host_kv
    assert st.prefill_streamed > 4 * len(prompt) // 16 and st.h2d_copies < st.prefill_streamed / 20
    tier = on.cache.host_tier
    tier.check()
    staged = tier.stage(1, [(0, 40), (100, 8)])
    for a, b in zip(staged.tensors(), tier.host[1].tensors()):  # the twin's bytes are the mapped pool's
        assert torch.equal(a, torch.cat((b[0:40], b[100:108])))
    off = _chunked_as(_cupy(tiny, on.cache.dense_alloc.num_pages, 0.0, kv_quant, True), on)
    assert off.generate([prompt], params)[0].token_ids == out.token_ids


def test_page_copy_kernel_moves_ranges_between_device_and_mapped_host_memory():
    """``ls_page_copy`` (the tier's page moves, one launch a batch): random pages of a device pool
    and a mapped host pool copied both ways equal torch's index copies, bytes for bytes, and no
    byte outside the target pages changes; ranges of different lengths (data, scales) in one batch."""
    import numpy as np

    from lserve.attention.cupy_tier import bulk_copy
    from lserve.cache.host_memory import mapped_zeros

    g = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")
    data_d = torch.randint(0, 256, (64, 4, 64, 64), dtype=torch.uint8, device=dev, generator=g)
    scale_d = torch.rand((64, 4, 64), device=dev, generator=g)
    data_h = mapped_zeros((96, 4, 64, 64), torch.uint8, dev)
    scale_h = mapped_zeros((96, 4, 64), torch.float32, dev)
    data_h.copy_(torch.randint(0, 256, data_h.shape, dtype=torch.uint8, device=dev, generator=g))
    scale_h.copy_(torch.rand(scale_h.shape, device=dev, generator=g))
    rng = np.random.default_rng(1)
    for src, dst in (((data_h, scale_h), (data_d, scale_d)), ((data_d, scale_d), (data_h, scale_h))):
        si = rng.choice(src[0].shape[0], 23, replace=False)
        di = rng.choice(dst[0].shape[0], 23, replace=False)
        want = [y.clone().index_copy_(0, torch.from_numpy(di).to(dev), x.index_select(0, torch.from_numpy(si).to(dev)))
                for x, y in zip(src, dst)]
        cols = []
        for x, y in zip(src, dst):
            page = x[0].numel() * x.element_size()
            cols.append(np.stack((x.data_ptr() + si * page, y.data_ptr() + di * page, np.full(si.size, page // 16))))
        bulk_copy(np.concatenate(cols, axis=1).astype(np.int64))
        torch.cuda.synchronize()
        for w, y in zip(want, dst):
            assert torch.equal(w, y)


@pytest.mark.parametrize("kv_quant", ["none", "int4"])
def test_cupy_tier_stages_host_picks_once_a_selection(kv_quant):
    """With room beside the pinned pages (30 slots: 14 pinned, 16 more), the tier sets aside a
    staging area (2 sequences x 2 picks a head); each selecting step copies the head parts of picks
    on the host there (``ls_stage_picks``) and the decode kernels read them from it: the staged
    bytes equal the host pool's while the sequences run, and outputs equal tier-off."""
    tiny = load_model("tiny", seed=3, device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = [DOC[:400] + q for q in (" Q: box 5? A:", " Q: which box is black? A:")]
    on = _cupy(tiny, 30, _cupy_gib(tiny, 60, kv_quant), kv_quant, True)
    tier = on.cache.host_tier
    assert (tier.stage_slots, tier.stage_entries, tier.num_slots, tier.stage_base) == (2, 2, 26, 26)
    rids = [on.add_request(p, params) for p in prompts]
    outs, checked = {}, 0
    while on.has_unfinished():
        for o in on.step():
            if o.finished:
                outs[o.request_id] = o
        state = on.backend.stage_state()
        if outs or state is None:  # a finished sequence's pages (and host slots) are given back
            continue
        torch.cuda.synchronize()
        page, cnt, stage = (t.cpu() for t in state)
        for layer, slot, head, e in (stage >= 0).nonzero().tolist():
            assert e < cnt[layer, slot, head] and stage[layer, slot, head, e] == tier.stage_base + slot * 2 + e
            _, host_slot, resident = tier.locate(layer, page[layer, slot, head, e].reshape(1))
            if resident.item():  # installed since: the kernels read it where it is now
                continue
            pool, host = on.cache.dense[layer].resident, tier.host[layer]
            for a, b in zip(pool.tensors(), host.tensors()):
                assert torch.equal(a[stage[layer, slot, head, e]][head].cpu(), b[host_slot.item()][head].cpu())
            checked += 1
    assert checked > 0 and on.graphs.replays > 0
    tier.check()
    off = _chunked_as(_cupy(tiny, on.cache.dense_alloc.num_pages, 0.0, kv_quant, True), on)
    want = off.generate(prompts, params)
    assert [o.token_ids for o in want] == [outs[r].token_ids for r in rids]
