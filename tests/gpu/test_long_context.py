"""Long-context decode (Llama-3-8B layer shape) against the torch oracle.

The history is the caches' random garbage (identical in both), so a 50k-token context costs no
prefill: sequences start decoding at position L - 1. Covers long index tables, split-K with
chunked units and the merge, selection over hundreds of pages, reuse, and a batch mixing a
sequence whose context fits the budget with ones that select.
"""

from __future__ import annotations

import pytest
import torch
from gpu_harness import Pair, Seq


@pytest.mark.parametrize("kv_quant,select_mode,budget", [("none", "kv", 4096), ("int8", "query", 4096),
                                                         ("int4", "kv", 4096), ("none", "kv", 0)])
def test_long_context_decode(kv_quant, select_mode, budget, seed):
    pair = Pair(seed=seed, dtype=torch.bfloat16, D=128, hkv=8, G=4, n_dense=(4,), page_size=64, logical=16,
                sink=128, local=256, budget=budget, reuse=2, kv_quant=kv_quant, select_mode=select_mode,
                num_pages=1200, max_seqs=4)
    seqs = [Seq(i, n, computed=n - 1) for i, n in enumerate((50001, 20011, 3001))]
    for _ in range(5):
        pair.step([(s, 1, True) for s in seqs])
    if budget:
        assert pair.selections_checked >= 6
    pair.compare_caches()
    print(f"max rel err {max(pair.errors):.3g}")

