"""Per-layer budgets: the allocation by hand (lserve.calibration.budgets), the ratios at run time
on the torch backend (lserve.sparsity.adaptive_budget: pages kept per layer, bytes read), and the refusal elsewhere."""

from __future__ import annotations

import json
import random

import pytest

from lserve.attention.base import AttentionBackend
from lserve.calibration.budgets import allocate, calibrate_budgets
from lserve.config import CacheConfig, ConfigError, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.models.loader import load_model
from lserve.sparsity.adaptive_budget import (
    ADAPTIVE_KIND,
    DEFAULT_RESAMPLE_SOURCE,
    layer_pages,
    load_ratios,
    resample_calibration,
    resample_ratios,
)

PAGES = CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=16 * 256)


def test_allocate_by_hand():
    curves = {0: [(128, 0.9), (256, 0.95), (512, 0.99)], 1: [(128, 0.5), (256, 0.7), (512, 0.8)]}
    # mean 384 per head, 2 heads: 768 tokens. Target 0.8 costs 128 + 512 = 640 (0.9 would need layer 1's
    # whole context, 1024); the 128 left go to layer 0's next step.
    assert allocate(curves, {0: 1, 1: 1}, 384, 1024) == {0: 256, 1: 512}
    # layer 1 has 3 dense heads: its tokens cost three times as much
    assert allocate(curves, {0: 1, 1: 3}, 256, 1024) == {0: 256, 1: 256}
    # a mean past every curve: the whole context where it keeps more
    assert allocate(curves, {0: 1, 1: 1}, 1024, 1024) == {0: 1024, 1: 1024}


def test_layer_pages():
    assert layer_pages(2.0, 8, 64) == 16
    assert layer_pages(0.3, 8, 64) == 2  # 153 tokens -> 2 whole pages
    assert layer_pages(0.01, 8, 64) == 1
    assert layer_pages(None, 8, 64) == 8


def _report(num_layers: int, dense: list[list[int]]) -> dict:
    """A selection-mass report with made-up curves: layer i keeps 1 - 0.6 (64 / b)^((i + 1) / 2) at budget b
    (the lower the layer, the more diffuse its attention)."""
    grid = [64, 128, 256, 512]
    layers = {"1024": {"bound_p64_l16": {str(b): [round(1 - 0.6 * (64 / b) ** ((i + 1) / 2), 4) if dense[i] else None
                                                 for i in range(num_layers)] for b in grid}}}
    return {"model": "tiny", "command": "test", "dense_heads": dense, "layers": layers}


def test_calibrate_budgets_meets_the_mean(tmp_path):
    dense = [[0, 1], [], [1], [0, 1]]
    r = calibrate_budgets(_report(4, dense), 1024, 256)
    assert r["kind"] == ADAPTIVE_KIND and r["ratios"][1] is None
    w = {0: 2, 2: 1, 3: 2}
    assert sum(w[i] * r["budgets"][i] for i in w) / 5 <= 256 == r["mean_budget"]
    # by hand: target 0.7 (layer 0 at 256; layers 2, 3 at 128) costs 896 of 1280; 0.788 would cost 1408. The
    # 384 left go to layer 2 (+0.137 for 128 tokens), then layer 3 (+0.1125 for 2 x 128).
    assert r["budgets"] == [256, None, 256, 256] and r["min_mass"] == 0.7 and r["mean"] == 256
    p = tmp_path / "a.json"
    p.write_text(json.dumps(r))
    assert load_ratios(p, 4) == tuple(r["ratios"])
    with pytest.raises(ConfigError, match="4 layers"):
        load_ratios(p, 5)
    with pytest.raises(ConfigError, match="no 'bound_p64_l16' curves at context 2048"):
        calibrate_budgets(_report(4, dense), 2048, 256)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=5)


def _engine(tiny, ratios_path: str) -> LLMEngine:
    sp = SparsityConfig(pattern="random", static_sparsity=0.5, sink_tokens=16, local_tokens=32, token_budget=64,
                        reuse_interval=2, dynamic_threshold=0, select_layers="all", adaptive_budgets=ratios_path)
    return LLMEngine(EngineConfig(model="tiny", sparsity=sp, cache=PAGES, max_num_seqs=2, max_batched_tokens=256),
                     tiny)


def test_torch_backend_keeps_each_layers_pages_and_meters_them(tiny, tmp_path):
    ratios = [0.5, 1.0, 2.0, 100.0]  # layer 3 reads everything
    p = tmp_path / "ratios.json"
    p.write_text(json.dumps({"kind": ADAPTIVE_KIND, "ratios": ratios}))
    eng = _engine(tiny, str(p))
    be = eng.backend
    kept: dict[int, set] = {}
    inner = be._page_table

    def spy(layer, sp, qd, *k):
        table = inner(layer, sp, qd, *k)
        if sp.select:
            kept.setdefault(layer, set()).add(k[0])
        return table

    be._page_table = spy
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(300)] for _ in range(2)]
    eng.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    # budget 64 = 4 pages of 16: layers keep 2, 4, 8 pages; layer 3's 400 cover the context (no selection)
    selecting = {i for i in range(4) if be.layer_selects(i)}
    assert {i: kept[i] for i in kept} == {i: {[2, 4, 8][i]} for i in selecting - {3}}
    total = eng.stats().kv_read
    hand = 0
    n_dense, H = be.cache.n_dense, be.model.num_kv_heads
    for length in range(301, 306):  # the 5 decode steps of each prompt (reuse interval 2: pages at select)
        at = [301, 301, 303, 303, 305][length - 301]
        sel = -(-at // 16)
        for i in range(4):
            if i in selecting and i != 3:
                k = [2, 4, 8][i]
                hand += n_dense[i] * min(length, (k - 1) * 16 + length - (sel - 1) * 16)
            else:
                hand += n_dense[i] * length
            ring = be.cache.ring
            hand += (H - n_dense[i]) * sum(min(16, length - j * 16) for j in ring.page_in_slot(length) if j >= 0)
    assert total.read == 2 * hand and total.steps == 10


def test_other_backends_refuse_adaptive_budgets(tiny, tmp_path):
    class Other(AttentionBackend):
        name = "other"

        def run(self, layer, q, k, v, plan):
            raise NotImplementedError

    p = tmp_path / "ratios.json"
    p.write_text(json.dumps({"kind": ADAPTIVE_KIND, "ratios": [1.0] * 4}))
    eng = _engine(tiny, str(p))
    with pytest.raises(ConfigError, match="torch and cupy backends only"):
        Other(eng.backend.model, eng.backend.sp, eng.cache)
    with pytest.raises(ConfigError, match="no shipped adaptive budgets"):
        _engine(tiny, "auto")


def test_resample_ratios_by_relative_depth_keeps_the_weighted_mean():
    # same layer count, mean already 1: unchanged
    assert resample_ratios([2.0, 1.0, 0.5, 0.5], [1, 1, 1, 1]) == [2.0, 1.0, 0.5, 0.5]
    # 3 -> 5 layers: depths 0, .25, .5, .75, 1 give 1, 1.5, 2, 2.5, 3 (mean 2), then halved
    assert resample_ratios([1.0, 2.0, 3.0], [1] * 5) == [0.5, 0.75, 1.0, 1.25, 1.5]
    # a source layer without dense heads is interpolated across; a target layer without any gets None
    assert resample_ratios([2.0, None, 0.0], [1, 1, 1]) == [2.0, 1.0, 0.0]
    out = resample_ratios([1.0, 3.0], [1, 0, 3])  # raw 1, 2, 3; weighted mean (1 + 9) / 4 = 2.5
    assert out == [0.4, None, 1.2] and (1 * out[0] + 3 * out[2]) / 4 == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="cannot resample"):
        resample_ratios([None, None], [1, 1])


def test_resampled_default_calibration_for_32_layers(tmp_path):
    src = json.loads(DEFAULT_RESAMPLE_SOURCE.read_text())
    dense = [4] * 16 + [3, 5] * 8
    rec = resample_calibration(dense)
    assert rec["resampled"] is True and rec["kind"] == ADAPTIVE_KIND
    assert rec["resampled_from"] == "lserve/patterns/smollm2-135m/adaptive_budgets.json"
    assert rec["source_layers"] == len(src["ratios"]) == 30 and rec["layers"] == 32
    r = rec["ratios"]
    assert None not in r and sum(n * x for n, x in zip(dense, r)) / sum(dense) == pytest.approx(1.0, abs=1e-3)
    # the ends follow the source's ends (layer 0: 2.0, last layer with dense heads: 0.1875), scaled alike
    scale = r[0] / src["ratios"][0]
    assert r[-1] == pytest.approx(0.1875 * scale, abs=1e-3) and 1.0 < scale < 1.3
    # its peak (source layer 18, ratio 4, at depth 0.62) lands at the target layer nearest that depth
    assert r.index(max(r)) == round(18 / 29 * 31)
    p = tmp_path / "r.json"
    p.write_text(json.dumps(rec))
    assert load_ratios(p, 32) == tuple(r)  # a file the engine takes with --adaptive-budgets PATH


def test_sparsity_summary_says_budgets_are_adaptive_with_their_mean(tiny, tmp_path):
    """The one line ``lserve serve`` prints at start and ``/v1/models`` shows (``sparsity.summary``)."""
    from dataclasses import replace

    from lserve.sparsity.in_effect import in_effect

    p = tmp_path / "ratios.json"
    p.write_text(json.dumps({"kind": ADAPTIVE_KIND, "ratios": [0.5, 1.0, 2.0, 0.5]}))
    eng = _engine(tiny, str(p))
    facts = eng.describe()["sparsity"]
    frac = facts["streaming_fraction"]
    assert 0 < frac < 1
    assert facts["summary"] == (f"pattern random ({frac:g} of KV heads streaming); decode budgets adaptive ({p}), "
                                "mean 64 tokens, selecting layers all; prefill sparsity off")
    sp = eng.sparsity  # the settings in effect (auto resolved)
    uniform = in_effect(replace(sp, adaptive_budgets="", prefill_sparsity=0.9), tiny.config, frac)["summary"]
    assert uniform == (f"pattern random ({frac:g} of KV heads streaming); decode budget uniform 64 tokens, "
                       "selecting layers all; prefill sparsity on, tau 0.9 from 4096 tokens")  # unprofiled tiny
    off = in_effect(replace(sp, token_budget=0, static_sparsity=0.0), tiny.config, 0.0)["summary"]
    assert off == "pattern none (0 of KV heads streaming); decode page selection off (token budget 0); prefill sparsity off"
