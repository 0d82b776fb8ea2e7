"""The accuracy harness: configuration parsing, budgets, grouping, JSON schema, resume, plots."""

from __future__ import annotations

import json

import pytest

from lserve.config import ConfigError
from lserve.eval.cli import print_table
from lserve.eval.harness import EvalPlan, Harness, RunConfig, compare, parse_config
from lserve.models.loader import load_model
from lserve.sparsity.shipped import default_pattern_for, resolve_pattern


def test_parse_config_presets_variants_and_errors():
    assert parse_config("dense").budget == "0" and parse_config("dense").pattern is None
    ls = parse_config("lserve")
    assert (ls.pattern, ls.static_sparsity, ls.budget, ls.min_budget, ls.reuse_interval) == ("learned", 0.5, "1/8", 512, 4)
    sw = parse_config("lserve@1/32")
    assert sw.name == "lserve@1/32" and sw.budget == "1/32" and sw.min_budget == 0 and sw.pattern == "learned"
    mine = parse_config("mine:pattern=random,budget=1024,reuse_interval=8,static_sparsity=0.25")
    assert (mine.pattern, mine.budget, mine.reuse_interval, mine.static_sparsity) == ("random", "1024", 8, 0.25)
    assert parse_config("lserve:pattern=none").pattern is None
    for bad in ("nosuch", "lserve:colour=red", "x:budget=abc", "lserve@1/0"):
        with pytest.raises(ConfigError):
            parse_config(bad)


def test_budgets_follow_the_context_with_floors():
    ls = parse_config("lserve")
    assert [ls.budget_for(n) for n in (2048, 4096, 8192)] == [512, 512, 1024]
    assert parse_config("lserve@1/32").budget_for(2048) == 128  # never below two pages
    assert parse_config("lserve@1/2").budget_for(8192) == 4096
    assert parse_config("x:budget=1024").budget_for(2048) == 1024
    assert parse_config("dense").budget_for(8192) == 0


def test_engine_groups_share_prefills_only_when_allowed():
    key = {n: parse_config(n).engine_key() for n in ("dense", "dynamic", "static", "lserve", "lserve@1/4",
                                                      "lserve-no-reuse", "lserve-random-pattern")}
    assert key["dense"] == key["dynamic"]
    assert key["static"] == key["lserve"] == key["lserve@1/4"]
    assert key["lserve"] != key["lserve-no-reuse"] and key["lserve"] != key["lserve-random-pattern"]


def test_resolve_learned_pattern(smol):
    tiny = load_model("tiny").config
    assert resolve_pattern("learned", smol.config) == str(default_pattern_for(smol.config))
    assert resolve_pattern("random", tiny) == "random"
    with pytest.raises(ConfigError, match="no learned head pattern ships for model 'tiny'"):
        resolve_pattern("learned", tiny)


def test_compare_pairs():
    rows = [{"config": c, "task": "niah", "context": 2048, "accuracy": a, "n": 10}
            for c, a in (("dense", 90.0), ("lserve", 80.0), ("lserve-no-reuse", 80.0))]
    out = {(r["a"], r["b"]): r for r in compare(rows)}
    assert out[("lserve", "dense")]["diff"] == -10.0 and out[("lserve", "lserve-no-reuse")]["diff"] == 0.0
    assert out[("lserve", "dense")]["stderr_diff"] > 0


def test_end_to_end_on_tiny_model(tmp_path, capsys):
    tiny = load_model("tiny", seed=0)
    configs = [RunConfig("dense"), parse_config("rnd:pattern=random,budget=128"), parse_config("rnd@1/2")]
    plan = EvalPlan(tasks=["passkey"], contexts=[512, 640], depths=[0.25, 0.75], samples=1)
    out = str(tmp_path / "acc")
    h = Harness(model="tiny", out=out, batch_size=2, progress=False, loaded=tiny, command="test")
    s = h.run(configs, plan)
    assert s["status"] == "complete"
    rows = s["rows"]
    assert len(rows) == 3 * 2
    for r in rows:
        assert {"config", "task", "context", "budget", "accuracy", "n"} <= set(r)
        assert 0 <= r["accuracy"] <= 100 and r["n"] == 2
    budgets = {(r["config"], r["context"]): r["budget"] for r in rows}
    assert budgets[("rnd", 512)] == 128 and budgets[("rnd@1/2", 640)] == 320 and budgets[("dense", 512)] == 0
    # decode KV bytes read vs dense: all of it for dense; less with streaming heads, less again at a smaller budget
    kv = {(r["config"], r["context"]): r["kv_read_fraction"] for r in rows}
    assert kv[("dense", 512)] == kv[("dense", 640)] == 1.0
    assert 0 < kv[("rnd", 640)] < kv[("rnd@1/2", 640)] < 1
    assert json.loads((tmp_path / "acc.json").read_text())["rows"] == rows
    assert (tmp_path / "acc_heatmap_passkey.png").is_file() and (tmp_path / "acc_budget.png").is_file()
    assert (tmp_path / "acc_bytes.png").is_file()  # accuracy against the KV bytes read
    lines = (tmp_path / "acc.cases.jsonl").read_text().splitlines()
    assert len(lines) == 3 * 4
    # Resume: nothing is recomputed; and running without forking reproduces every output.
    Harness(model="tiny", out=out, batch_size=2, progress=False, loaded=tiny).run(configs, plan)
    assert len((tmp_path / "acc.cases.jsonl").read_text().splitlines()) == len(lines)
    h2 = Harness(model="tiny", out=str(tmp_path / "nofork"), batch_size=2, progress=False, loaded=tiny, fork=False)
    h2.run(configs, plan)
    a = {(r["config"], r["key"]): (r["output"], r["kv_read_head_tokens"]) for r in map(json.loads, lines)}
    nofork = (tmp_path / "nofork.cases.jsonl").read_text().splitlines()
    b = {(r["config"], r["key"]): (r["output"], r["kv_read_head_tokens"]) for r in map(json.loads, nofork)}
    assert a == b  # same outputs and the same KV reads, forked or not
    print_table(s)
    assert "passkey" in capsys.readouterr().out


def test_rope_scaling_override_reaches_the_engine(tmp_path):
    """``lserve eval --rope-scaling``: the engines run the scaled RoPE (other outputs); bad values are one line."""
    import subprocess
    import sys

    def run(*extra):
        out = tmp_path / ("scaled" if extra else "plain")
        r = subprocess.run([sys.executable, "-m", "lserve", "eval", "--model", "tiny", "--tasks", "passkey",
                            "--contexts", "384", "--depths", "0.5", "--configs", "dense", "--out", str(out),
                            "--quiet", *extra], capture_output=True, text=True, timeout=600)
        return r, out

    r0, plain = run()
    r1, scaled = run("--rope-scaling", "linear:4")
    assert r0.returncode == 0 and r1.returncode == 0, r0.stderr + r1.stderr
    outs = [json.loads((p.parent / (p.name + ".cases.jsonl")).read_text().splitlines()[0])["output"]
            for p in (plain, scaled)]
    assert outs[0] != outs[1]  # positions divided by 4: a different random-weight continuation
    assert "--rope-scaling linear:4" in json.loads((tmp_path / "scaled.json").read_text())["command"]
    bad, _ = run("--rope-scaling", "yarn:2")
    assert bad.returncode == 2 and "expected linear:FACTOR or dynamic:FACTOR" in bad.stderr
    assert "Traceback" not in bad.stderr

    h = Harness(model="tiny", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert h.with_rope_scaling(load_model("tiny")).config.rope_scaling == {"rope_type": "dynamic", "factor": 2.0}
