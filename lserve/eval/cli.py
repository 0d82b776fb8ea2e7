"""``lserve eval``: argparse wiring (``register(subparsers)``) and the accuracy table it prints."""

from __future__ import annotations

import argparse
import shlex
import sys

DEFAULT_CONFIGS = ["dense", "static", "lserve", "lserve-no-reuse", "lserve-random-pattern"]


def set_threads(n: int, device: str) -> None:
    """Torch CPU threads of a command's ``--threads`` (0: torch's default; ignored on a GPU)."""
    import torch

    if n > 0 and not device.startswith("cuda"):
        torch.set_num_threads(n)


def cmd_eval(a: argparse.Namespace) -> int:
    from lserve.eval.harness import EvalPlan, Harness, parse_config

    set_threads(a.threads, a.device)
    configs = [parse_config(s) for s in a.configs]
    configs += [parse_config(f"{a.sweep_base}@{b}") for b in a.budget_sweep or []]
    names = [c.name for c in configs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        from lserve.config import ConfigError

        raise ConfigError(f"configuration names must be unique, repeated: {', '.join(sorted(dup))}")
    plan = EvalPlan(tasks=a.tasks, contexts=a.contexts, depths=a.depths, samples=a.samples, seed=a.seed,
                    haystack=a.haystack)
    h = Harness(model=a.model, out=a.out, device=a.device, dtype=a.dtype, backend=a.backend, batch_size=a.batch_size,
                max_batched_tokens=a.max_batched_tokens,
                command="" if a.summarize_only else "lserve " + shlex.join(sys.argv[1:]),
                progress=not a.quiet, fork=a.fork, rope_scaling=a.rope_scaling)
    summary = h.summarize(configs, plan, plan.cases(_tokenizer(h))) if a.summarize_only else h.run(configs, plan)
    print_table(summary)
    print(f"wrote {a.out}.json ({summary['status']})")
    return 0


def _tokenizer(h):
    from lserve.models.loader import load_model

    h.loaded = h.with_rope_scaling(load_model(h.model))
    return h.loaded.tokenizer


def print_table(summary: dict) -> None:
    """Accuracy table: one line per (task, context), one column per configuration."""
    rows = summary["rows"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    cells = {(r["config"], r["task"], r["context"]): r for r in rows}
    keys = sorted({(r["task"], r["context"]) for r in rows})
    width = max([len(c) for c in configs] + [6])
    print(f"{'task':<16}{'ctx':>6} " + " ".join(f"{c:>{width}}" for c in configs))
    for task, ctx in keys:
        vals = [cells.get((c, task, ctx)) for c in configs]
        print(f"{task:<16}{ctx:>6} " + " ".join(f"{v['accuracy']:>{width}.1f}" if v else " " * (width - 1) + "-"
                                                 for v in vals))


def budget_spec(s: str) -> str:
    """argparse type of a token budget: a token count or a fraction of the context (``"1/8"``)."""
    from fractions import Fraction

    try:
        Fraction(s)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"not a token count or fraction: {s!r}") from None
    return s


def _rope_scaling(s: str) -> dict:
    kind, _, factor = s.partition(":")
    try:
        f = float(factor)
    except ValueError:
        f = 0.0
    if kind not in ("linear", "dynamic") or not f > 1.0:
        raise argparse.ArgumentTypeError(f"expected linear:FACTOR or dynamic:FACTOR with FACTOR > 1, got {s!r}")
    return {"rope_type": kind, "factor": f}


def register(sub) -> None:
    """Add ``eval`` to an ``argparse`` subparsers object."""
    e = sub.add_parser("eval", help="accuracy of engine configurations side by side on generated long-context tasks",
                       description="Configurations: presets (dense, static, static-random-pattern, dynamic, lserve, "
                                   "lserve-all-layers, lserve-adaptive, lserve-no-reuse, lserve-random-pattern, "
                                   "lserve-query-select), "
                                   "NAME@BUDGET, or "
                                   "NAME:key=value,... (keys: pattern, static_sparsity, budget, min_budget, "
                                   "reuse_interval, select_mode, dense_layers, pattern_seed, kv_quant, logical_page_size, "
                                   "select_layers, adaptive_budgets).")
    e.add_argument("--model", default="default")
    e.add_argument("--tasks", nargs="+", default=["passkey", "niah"],
                   choices=["passkey", "niah", "niah-multikey", "niah-multivalue", "vt", "cwe"])
    e.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    e.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    e.add_argument("--samples", type=int, default=1, help="prompts per (task, context, depth)")
    e.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    e.add_argument("--budget-sweep", type=budget_spec, nargs="*", default=None,
                   help="also run SWEEP_BASE@B for each budget B (e.g. 1/32 1/16 1/8 1/4 1/2)")
    e.add_argument("--sweep-base", default="lserve")
    e.add_argument("--haystack", default=None, choices=["sentences", "filler"], help="override each task's haystack")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--rope-scaling", type=_rope_scaling, default=None, metavar="TYPE:FACTOR",
                   help="replace the model's RoPE scaling, e.g. dynamic:2 or linear:2 (contexts past the "
                        "trained length)")
    e.add_argument("--out", default="benchmarks/accuracy", help="output stem: OUT.json, OUT.cases.jsonl, OUT_*.png")
    e.add_argument("--device", default="cpu")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    e.add_argument("--backend", default="torch", choices=["torch", "cupy"])
    e.add_argument("--batch-size", type=int, default=4, help="prompts per engine batch")
    e.add_argument("--max-batched-tokens", type=int, default=4096, help="engine prefill chunk")
    e.add_argument("--threads", type=int, default=2, help="CPU threads (0: torch's default)")
    e.add_argument("--fork", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill each prompt once per engine and fork it into the budget variants (same results)")
    e.add_argument("--summarize-only", action="store_true", help="rebuild OUT.json and plots from OUT.cases.jsonl")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=cmd_eval)
