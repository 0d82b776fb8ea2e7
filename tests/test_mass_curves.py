"""Mass-kept curves (lserve.calibration.mass_curves) against the engine's own key statistics and
selector, and the ordering the diagnosis relies on (bound <= page oracle <= token oracle)."""

from __future__ import annotations

import pytest
import torch

from lserve.bench.selection_mass import SelectionMassConfig, layer_masses
from lserve.cache.key_stats import KeyStats
from lserve.calibration.mass_curves import (
    kept_mass_curve,
    key_stats_from_keys,
    mass_at_budgets,
    page_mass,
    token_oracle_at_budgets,
)
from lserve.sparsity.selector import page_scores, top_pages


@pytest.mark.parametrize("page,logical,length", [(16, 4, 100), (64, 16, 640), (32, 8, 33)])
def test_key_stats_from_keys_equal_the_cache_statistics(page, logical, length):
    g = torch.Generator().manual_seed(0)
    h, d = 3, 8
    k = torch.randn(h, length, d, generator=g)  # [H, L, D]
    n = -(-length // page)
    stats = KeyStats(n + 2, h, page, logical, d, torch.float32, "cpu")
    pages = torch.tensor([n + 1 - i for i in range(n)])  # a scattered page table
    pos = torch.arange(length)
    stats.update(pages[pos // page], pos % page, k.transpose(0, 1))
    kmax, kmin = key_stats_from_keys(k, page, logical)  # [n, g, H, D]
    filled = -(-length // logical)  # logical pages holding tokens
    ref_max = stats.kmax[pages].reshape(n * (page // logical), h, d)[:filled]
    ref_min = stats.kmin[pages].reshape(n * (page // logical), h, d)[:filled]
    assert torch.equal(kmax.reshape(-1, h, d)[:filled], ref_max)
    assert torch.equal(kmin.reshape(-1, h, d)[:filled], ref_min)


def test_curve_at_k_is_the_mass_of_the_selectors_pages():
    g = torch.Generator().manual_seed(1)
    h, G, d, length, page = 2, 3, 16, 500, 32
    q, k = torch.randn(h * G, d, generator=g), torch.randn(h, length, d, generator=g)
    p = torch.softmax(torch.bmm(q.view(h, G, d), k.transpose(1, 2)), -1).mean(1)  # [H, L]
    pm = page_mass(p, page)  # [H, n]
    assert pm.shape == (h, 16) and torch.allclose(pm.sum(1), torch.ones(h))
    kmax, kmin = key_stats_from_keys(k, page, 8)
    scores = page_scores(q, kmax, kmin, G, "kv")  # [H, n]
    curve = kept_mass_curve(pm, scores)
    for kk in (2, 5, 9):
        idx = top_pages(scores, kk)  # [H, K]: the engine's choice
        assert torch.allclose(curve[:, kk - 1], pm.gather(1, idx).sum(1), atol=1e-6)
    oracle = kept_mass_curve(pm, pm)
    assert (oracle >= curve - 1e-6).all()  # nothing beats the exact top pages
    budgets = [64, 160, 448, 1024]
    tok = token_oracle_at_budgets(p, budgets)  # [B, H]
    at = mass_at_budgets(oracle, budgets, page)
    assert (tok >= at - 1e-6).all()
    assert torch.equal(at[-1], torch.ones(h))  # a budget past the context reads everything
    assert torch.allclose(at[0], oracle[:, 1])  # 64 tokens = 2 pages


def test_layer_masses_methods_and_order():
    cfg = SelectionMassConfig(budgets=(128, 256))
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(6, 16, generator=g), torch.randn(2, 700, 16, generator=g)
    got = layer_masses(q, k, 0.25, 3, cfg)
    assert set(got) == set(cfg.methods())
    for m, v in got.items():
        assert v.shape == (len(cfg.grid()), 2) and (v <= 1 + 1e-5).all() and (v > 0).all(), m
        assert (v[1:] >= v[:-1] - 1e-6).all(), m  # more budget never keeps less
    for size, logical in cfg.page_configs:
        assert (got[f"oracle_p{size}"] >= got[f"bound_p{size}_l{logical}"] - 1e-6).all()
        assert (got["oracle_token"] >= got[f"oracle_p{size}"] - 1e-6).all()
    assert (got["oracle_p16"] >= got["oracle_p64"] - 1e-6).all()  # finer pages, better oracle
