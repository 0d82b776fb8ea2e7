"""Host KV tier with the resident set on the GPU and the host pool in CPU memory (torch backend):
greedy outputs equal with the tier on and off while pages cross devices every step."""

from __future__ import annotations

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
        off = _engine(tiny, on.cache.dense_alloc.num_pages, 0.0, kv_quant)
        assert [o.token_ids for o in off.generate(prompts, params)] == [o.token_ids for o in outs]
