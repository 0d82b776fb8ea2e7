"""Block-sparse prefill settings outside the engine: ``lserve`` flags, serve settings, eval preset."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lserve.cli import build_parser, engine_config_from_args
from lserve.config import ConfigError
from lserve.eval.harness import EvalPlan, Harness, parse_config
from lserve.serve.settings import ServeSettings

#: A prompt of a few hundred tokens: several 64-query rows for the block lists.
PROMPT = " ".join(f"item {i} is {i * 7 % 13}." for i in range(60))
SPARSE_FLAGS = ["--prefill-sparsity", "0.9", "--prefill-sparsity-min-len", "0", "--prefill-q-block", "64",
                "--prefill-block", "64"]


def lserve(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m lserve ARGS`` (as tests/test_cli.py runs it)."""
    return subprocess.run([sys.executable, "-m", "lserve", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_with_prefill_sparsity_flags(smol):  # smol: the weight cache is warm
    r = lserve("generate", PROMPT, "--max-tokens", "3", *SPARSE_FLAGS)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), r.stderr
    assert "generated tokens" in r.stderr and "Traceback" not in r.stderr


def test_flags_reach_the_backend(smol):
    """The parsed flags build an engine whose prefill skips blocks (the subprocess above cannot show it)."""
    from lserve.engine import LLMEngine, SamplingParams

    a = build_parser().parse_args(["generate", "x", "--device", "cpu", *SPARSE_FLAGS, "--prefill-estimator", "bound"])
    cfg = engine_config_from_args(a)
    sp = cfg.sparsity
    assert (sp.prefill_sparsity, sp.prefill_sparsity_min_len, sp.prefill_block, sp.prefill_q_block,
            sp.prefill_estimator) == (0.9, 0, 64, 64, "bound")
    eng = LLMEngine(cfg, smol)
    out = eng.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 2
    kept, causal = eng.backend.prefill_tiles
    assert 0 < kept < causal


def test_prefill_flags_default_auto():
    sp = engine_config_from_args(build_parser().parse_args(["generate"])).sparsity
    assert (sp.prefill_sparsity, sp.prefill_sparsity_min_len, sp.prefill_block, sp.prefill_q_block,
            sp.prefill_estimator) == (-1.0, -1, 64, 2048, "antidiagonal")  # -1: auto (calibration, profile)


@pytest.mark.parametrize("args, message", [
    (["--prefill-sparsity", "1.5"], "prefill_sparsity must be in [0, 1]"),
    (["--prefill-q-block", "100"], "prefill_q_block must be a multiple of prefill_block"),
    (["--prefill-block", "12"], "prefill_block must be"),
    (["--prefill-sparsity-min-len", "-2"], "prefill_sparsity_min_len must be >= 0 (or -1: auto)"),
])
def test_bad_prefill_values_print_one_line(args, message):
    r = lserve("generate", "hi", "--model", "tiny", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lserve: error:") and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_estimator_is_refused_by_the_parser():
    r = lserve("generate", "hi", "--model", "tiny", "--prefill-estimator", "magic")
    assert r.returncode == 2 and "--prefill-estimator" in r.stderr and "invalid choice" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_serve_settings_carry_prefill_sparsity():
    s = ServeSettings(device="cpu", prefill_sparsity=0.9, prefill_sparsity_min_len=0, prefill_q_block=256)
    sp = s.engine_config().sparsity
    assert (sp.prefill_sparsity, sp.prefill_sparsity_min_len, sp.prefill_q_block) == (0.9, 0, 256)
    assert ServeSettings.from_dict(s.to_dict()).engine_config().sparsity == sp  # what deployments receive
    # the YAML / ``serve run key=value`` spelling: dashes and strings
    sp = ServeSettings.from_dict({"device": "cpu", "prefill-sparsity": "0.8", "prefill_block": "32",
                                  "prefill_q_block": "128", "prefill_estimator": "bound"}).engine_config().sparsity
    assert (sp.prefill_sparsity, sp.prefill_block, sp.prefill_q_block, sp.prefill_estimator) == (0.8, 32, 128, "bound")
    # ``lserve serve`` flags
    args = build_parser().parse_args(["serve", "--device", "cpu", "--prefill-sparsity", "0.9"])
    assert ServeSettings.from_args(args).engine_config().sparsity.prefill_sparsity == 0.9
    assert ServeSettings(device="cpu").engine_config().sparsity.prefill_sparsity == -1.0  # auto
    with pytest.raises(ConfigError, match="prefill_q_block must be a multiple"):
        ServeSettings.from_dict({"device": "cpu", "prefill_q_block": "100"})


def test_eval_preset_and_overrides(smol):
    rc = parse_config("lserve-prefill-sparse")
    base = parse_config("lserve")
    assert (rc.prefill_sparsity, rc.prefill_sparsity_min_len, rc.prefill_q_block) == (0.9, 0, 256)
    assert (rc.pattern, rc.budget, rc.min_budget) == (base.pattern, base.budget, base.min_budget)
    assert base.prefill_sparsity == 0.0
    assert rc.engine_key() != base.engine_key() and rc.engine_key(False) != base.engine_key(False)
    sp = rc.sparsity(smol.config)
    assert (sp.prefill_sparsity, sp.prefill_sparsity_min_len, sp.prefill_q_block) == (0.9, 0, 256)
    assert base.sparsity(smol.config).prefill_sparsity == 0.0
    o = parse_config("lserve-prefill-sparse:prefill_sparsity=0.8,prefill_q_block=512")
    assert (o.prefill_sparsity, o.prefill_q_block, o.prefill_sparsity_min_len) == (0.8, 512, 0)
    assert isinstance(o.prefill_sparsity, float) and isinstance(o.prefill_q_block, int)
    assert o.engine_key() != rc.engine_key()
    assert parse_config("x:prefill_sparsity=1").prefill_sparsity == 1.0  # an int spelling still gives a float


def test_eval_preset_runs_on_tiny_model(tmp_path):
    from lserve.models.loader import load_model

    rc = parse_config("lserve-prefill-sparse:pattern=random,prefill_sparsity=0.5")  # tiny: no learned pattern, flat attention
    plan = EvalPlan(tasks=["passkey"], contexts=[2048], depths=[0.5], samples=1)
    s = Harness(model="tiny", out=str(tmp_path / "acc"), batch_size=1, progress=False,
                loaded=load_model("tiny", seed=0)).run([rc], plan)
    assert s["status"] == "complete"
    assert [r["config"] for r in s["rows"]] == [rc.name]
    assert 0 < s["rows"][0]["prefill_kept_fraction"] < 1  # accuracy beside what the prefill computed
