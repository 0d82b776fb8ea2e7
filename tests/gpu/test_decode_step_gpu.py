"""The bench's pure decode step on the GPU: the timed steps of a batch are CUDA-graph replays
(the served engine's decode), a shared long prompt is prefilled once, and the step is positive."""

from __future__ import annotations

import torch

from lserve.bench.decode_step import SHARE_FROM, decode_engine, decode_step_s
from lserve.bench.serve import engine_sparsity
from lserve.models.loader import load_model


def test_decode_step_times_graph_replays_of_the_whole_batch():
    loaded = load_model("tiny", dtype=torch.bfloat16, device="cuda")
    for context in (512, SHARE_FROM + 512):
        eng = decode_engine(loaded, "tiny", engine_sparsity("lserve"), context, 4, "cuda", "cupy", steps=8)
        before = eng.stats().step_kinds.get("graph", 0)
        steps = [decode_step_s(eng, context, c, steps=8) for c in (1, 4)]
        assert all(s > 0 for s in steps)
        assert eng.stats().step_kinds.get("graph", 0) - before >= 16  # the timed steps replayed graphs
        if context > SHARE_FROM:
            assert eng.stats().prefix_cache_hits >= 3 * (context // eng.cache.page_size - 1) * eng.cache.page_size
