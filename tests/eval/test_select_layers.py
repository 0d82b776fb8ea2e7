"""``select_layers``: selection only in chosen layers, its calibration, and mismatch refusals."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

from lserve.calibration.selection import CalibrationConfig, MassProbe, calibrate_selection
from lserve.cli import main
from lserve.config import CacheConfig, ConfigError, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.models.loader import load_model
from lserve.sparsity.layer_select import default_calibration_for, load_calibration, resolve_select_layers

PAGES = CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=16 * 256)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=5)


def _engine(tiny, select_layers="all", budget=32, **kw) -> LLMEngine:
    sp = SparsityConfig(pattern="random", static_sparsity=0.5, sink_tokens=16, local_tokens=32,
                        token_budget=budget, reuse_interval=2, dynamic_threshold=0, select_layers=select_layers)
    return LLMEngine(EngineConfig(model="tiny", sparsity=sp, cache=PAGES, max_num_seqs=4, max_batched_tokens=128,
                                  **kw), tiny)


def _prompts(n=2, length=200):
    rng = random.Random(3)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _spy_layers(eng) -> list[int]:
    """Record the layer of every page-table build (selection or reuse) of the torch backend."""
    seen, inner = [], eng.backend._page_table

    def spy(layer, sp, qd, *k):
        seen.append(layer)
        return inner(layer, sp, qd, *k)

    eng.backend._page_table = spy
    return seen


def test_no_selecting_layer_equals_static_only(tiny):
    """select_layers "none" with a budget: exactly the static-only output, the selector never runs."""
    prompts = _prompts()
    static = [o.token_ids for o in _engine(tiny, budget=0).generate(prompts, GREEDY)]
    eng = _engine(tiny, select_layers="none")
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == static
    assert eng.backend.selector_stats.runs == 0 and eng.backend.selector_stats.reuses == 0
    # The budget does bite when every layer selects (else the equality above proves nothing).
    every = _engine(tiny, select_layers="all")
    assert [o.token_ids for o in every.generate(prompts, GREEDY)] != static
    assert every.backend.selector_stats.runs > 0


def test_subset_selects_only_there(tiny):
    prompts = _prompts()
    full = _engine(tiny, select_layers="all")
    full_seen = _spy_layers(full)
    full.generate(prompts, GREEDY)
    eng = _engine(tiny, select_layers="0,3")
    seen = _spy_layers(eng)
    eng.generate(prompts, GREEDY)
    dense_layers = {i for i, n in enumerate(eng.cache.n_dense) if n}
    assert {0, 3} < dense_layers  # random pattern seed 0: dense heads in layers 0, 2, 3
    assert set(seen) == {0, 3} and set(full_seen) == dense_layers
    sel, all_sel = eng.backend.selector_stats, full.backend.selector_stats
    # Same decode schedule per selecting layer: runs scale with the number of layers.
    assert sel.runs * len(dense_layers) == all_sel.runs * 2


def test_cli_refuses_out_of_range_and_mismatched_calibration(tiny, capsys, tmp_path):
    with pytest.raises(ConfigError, match="layer 7 but the model has 4 layers"):
        _engine(tiny, select_layers=(2, 7))
    shipped = default_calibration_for(load_model("default").config)
    assert shipped is not None  # the default model ships one (lserve/patterns/smollm2-135m)
    rc = main(["generate", "hi", "--model", "tiny", "--max-tokens", "2", "--select-layers", str(shipped)])
    err = capsys.readouterr().err
    assert rc == 2 and "is for 30 layers" in err and "has 4" in err
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"layers": [1]}))
    with pytest.raises(ConfigError, match="not a selection calibration"):
        _engine(tiny, select_layers=str(bad))


def test_shipped_calibration_is_consistent_and_auto_uses_it(smol):
    cal = load_calibration(default_calibration_for(smol.config))
    n = cal["num_layers"]
    assert len(cal["layer_mass"]) == len(cal["head_mass"]) == len(cal["dense_heads"]) == n
    thr = cal["settings"]["threshold"]
    expect = [i for i, m in enumerate(cal["layer_mass"]) if m is not None and m >= thr]
    assert cal["select_layers"] == expect
    for m, heads, row in zip(cal["layer_mass"], cal["dense_heads"], cal["head_mass"]):
        assert m == (min(row[h] for h in heads) if heads else None)
    flags = resolve_select_layers("auto", replace(smol.config, name="renamed"))  # found by identity, not name
    assert [i for i, f in enumerate(flags) if f] == expect
    other = replace(smol.config, name="SmolLM2-135M-Instruct.Q4_1", fingerprint="0" * 16)  # the name, other weights
    assert resolve_select_layers("auto", other) == (True,) * n  # no calibration: every layer


def test_calibration_json_shape_and_engine_use(tiny, tmp_path):
    out = tmp_path / "cal.json"
    cfg = CalibrationConfig(model="tiny", out=str(out), tasks=("passkey",), contexts=(400,), depths=(0.5,),
                            budget="128", min_budget=0, pattern="random", threshold=0.5)
    r = calibrate_selection(cfg, progress=False)
    data = json.loads(out.read_text())
    assert data["num_layers"] == 4 and data["num_kv_heads"] == 2
    assert len(data["head_mass"]) == 4 and all(len(row) == 2 for row in data["head_mass"])
    assert all(0 < m <= 1 for row in data["head_mass"] for m in row)
    assert data["observations"] == [7] * 4  # passkey: 8 tokens, the first from the prefill
    assert data["select_layers"] == [i for i, m in enumerate(data["layer_mass"]) if m is not None and m >= 0.5]
    assert r["select_layers"] == data["select_layers"]
    # Every layer with dense heads passes a zero-ish threshold; an engine takes the file as is.
    low = calibrate_selection(CalibrationConfig(**{**cfg.__dict__, "threshold": 1e-6, "out": str(tmp_path / "l.json")}),
                              progress=False)
    assert low["select_layers"] == [i for i, h in enumerate(low["dense_heads"]) if h]
    eng = _engine(tiny, select_layers=str(tmp_path / "l.json"))
    assert eng.backend.select_layers == tuple(bool(h) for h in low["dense_heads"])


def test_mass_probe_matches_brute_force(tiny):
    """The probe's mass equals a float64 computation from raw keys (scores by the SPEC formula)."""
    sp = SparsityConfig(pattern=None, token_budget=0, dynamic_threshold=0, select_layers="none")
    eng = LLMEngine(EngineConfig(model="tiny", sparsity=sp, cache=PAGES, max_num_seqs=1), tiny)
    probe = MassProbe(eng.backend, "kv")
    checked = []
    inner = probe.head_mass

    def check(layer, splan, q):
        got = inner(layer, splan, q)
        b = eng.backend
        N, G = b.cache.page_size, b.group
        k, _ = b._dense_kv(layer, splan.pages, splan.length)  # [H, L, D]
        k, qd = k.double(), q.double().view(k.shape[0], G, -1)
        for h in range(k.shape[0]):
            n = splan.n_pages
            lp = b.cache.cfg.logical_page_size
            best = []
            for p in range(n - 1):
                s = -float("inf")
                for j in range(p * N, min((p + 1) * N, splan.length), lp):
                    blk = k[h, j: j + lp]
                    kmax, kmin = blk.max(0).values, blk.min(0).values
                    s = max(s, max(float(torch.maximum(qd[h, g] * kmax, qd[h, g] * kmin).sum()) for g in range(G)))
                best.append((s, p))
            keep = {p for _, p in sorted(best, reverse=True)[: splan.budget_pages - 1]} | {n - 1}
            tok = torch.tensor([t for t in range(splan.length) if t // N in keep])
            prob = torch.softmax(qd[h] @ k[h].T * b.scale, dim=-1)  # [G, L]
            assert abs(float(prob[:, tok].sum(-1).mean()) - float(got[h])) < 1e-4
        checked.append(layer)
        return got

    probe.head_mass = check
    eng.generate([_prompts(1, 150)[0]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                        token_budget=48))
    assert len(checked) == 2 * 4  # two decode steps x four layers
    assert (probe.count == 2).all()
