"""Page selection at scale: 20k pages (top-k shared memory above 48 KB), per-request budgets
down to K = 1 (only the last page), and a sequence without selection in the same batch."""

from __future__ import annotations

import pytest
import torch
from gpu_harness import Pair, Seq


@pytest.mark.parametrize("select_mode", ["kv", "query"])
def test_selector_many_pages_and_budgets(select_mode, seed):
    pair = Pair(seed=seed, dtype=torch.bfloat16, D=64, hkv=2, G=4, n_dense=(2,), page_size=16, logical=4,
                budget=4096, reuse=1, select_mode=select_mode, num_pages=21000, max_seqs=4)
    seqs = [Seq(0, 320_011, computed=320_010), Seq(1, 5003, computed=5002, budget=16),
            Seq(2, 777, computed=776, budget=0), Seq(3, 9001, computed=9000, budget=48)]
    for _ in range(3):
        pair.step([(s, 1, True) for s in seqs])
    assert pair.selections_checked == 9  # three selecting sequences, every step (reuse interval 1)
    pair.compare_caches()


@pytest.mark.parametrize("select_mode", ["kv", "query"])
def test_selector_outlier_page_crowds_the_linear_bins(select_mode, seed):
    """One page scoring ~1e4x the others puts every other page into the lowest bins of the
    top-k's linear histogram: the 20k-token sequence's boundary bin then holds more keys than
    the CTA has threads (radix fallback), the 5k-token one's a few hundred (ranked directly)."""
    pair = Pair(seed=seed, dtype=torch.bfloat16, D=64, hkv=2, G=4, n_dense=(2,), page_size=16, logical=4,
                budget=256, reuse=1, select_mode=select_mode, num_pages=2000, max_seqs=2)
    seqs = [Seq(0, 20_011, computed=20_010), Seq(1, 5003, computed=5002)]
    pair.step([(s, 1, True) for s in seqs])
    for s in seqs:
        for cache in (pair.cache_t, pair.cache_c):
            st = cache.stats[0]
            st.kmax[s.dense_pages[3]] *= 10_000
            st.kmin[s.dense_pages[3]] *= 10_000
    for _ in range(2):
        pair.step([(s, 1, True) for s in seqs])
    assert pair.selections_checked == 6
    pair.compare_caches()
