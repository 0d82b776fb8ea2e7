"""The kernel benchmark's adaptive comparison on the GPU, small: one cache, a backend per budget,
each timed on reuse steps and over a reuse cycle (what ``--adaptive-budgets`` runs at 64k-256k)."""

from __future__ import annotations

import lserve.bench.kernels as kernels
from lserve.models.presets import layer_config


def test_adaptive_row_times_every_distinct_budget():
    mc = layer_config("llama3-8b")
    tokens = [1024, 4096, 8192, 1024]
    row = kernels.adaptive_row(mc, 32768, tokens)
    assert set(row["per_budget"]) == {"1024", "4096", "8192"}
    for t in row["per_budget"].values():
        assert t["attention_ms"] > 0 and t["cycle_ms"] > 0
    # a budget reads more pages: the 8192 step costs at least the 1024 one (kernel time grows with K)
    assert row["per_budget"]["8192"]["attention_ms"] >= 0.9 * row["per_budget"]["1024"]["attention_ms"]
    per = row["per_budget"]
    assert row["adaptive_attention_ms"] == sum(per[str(t)]["attention_ms"] for t in tokens)
    assert row["uniform_attention_ms"] == 4 * per["4096"]["attention_ms"]
