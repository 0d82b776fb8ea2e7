"""``lserve classify-heads`` and ``lserve eval``: argparse wiring (``register(subparsers)``)."""

from __future__ import annotations

import argparse
import shlex
import sys

DEFAULT_CONFIGS = ["dense", "static", "lserve", "lserve-no-reuse", "lserve-random-pattern"]


def _threads(n: int, device: str) -> None:
    import torch

    if n > 0 and not device.startswith("cuda"):
        torch.set_num_threads(n)


def cmd_classify_heads(a: argparse.Namespace) -> int:
    from lserve.sparsity.classifier import GateTrainConfig, train_gates

    _threads(a.threads, a.device)
    cfg = GateTrainConfig(model=a.model, out=a.out, steps=a.steps, lr=a.lr, reg=a.reg, sink_tokens=a.sink,
                          local_tokens=a.local, min_context=a.min_context, max_context=a.max_context,
                          num_passkeys=a.num_passkeys, key_kind=a.key_kind, batch_size=a.batch_size, init=a.init,
                          seed=a.seed, device=a.device, dtype=a.dtype, checkpoint_every=a.checkpoint_every,
                          grad_checkpoint=a.grad_checkpoint, resume=a.resume,
                          extra={"command": "lserve " + shlex.join(sys.argv[1:])})
    pattern = train_gates(cfg, progress=not a.quiet)
    a_ = pattern.alphas
    print(f"wrote {a.out}/full_attention_heads.tsv ({a_.shape[0]} layers x {a_.shape[1]} KV heads); "
          f"gates < 0.5: {int((a_ < 0.5).sum())} of {a_.size}, mean {a_.mean():.3f}")
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from lserve.eval.harness import EvalPlan, Harness, parse_config

    _threads(a.threads, a.device)
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
                progress=not a.quiet, fork=a.fork)
    summary = h.summarize(configs, plan, plan.cases(_tokenizer(h))) if a.summarize_only else h.run(configs, plan)
    print_table(summary)
    print(f"wrote {a.out}.json ({summary['status']})")
    return 0


def _tokenizer(h):
    from lserve.models.loader import load_model

    h.loaded = load_model(h.model)
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


def _budget(s: str) -> str:
    from fractions import Fraction

    try:
        Fraction(s)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"not a token count or fraction: {s!r}") from None
    return s


def register(sub) -> None:
    """Add ``classify-heads`` and ``eval`` to an ``argparse`` subparsers object."""
    c = sub.add_parser("classify-heads", help="learn streaming/retrieval gates per KV head (DuoAttention-style)",
                       description="Train one gate per (layer, KV head) on synthetic multi-passkey data; writes "
                                   "full_attention_heads.tsv + config.json (use as --pattern DIR).")
    c.add_argument("--model", default="default", help="model spec as for `lserve generate`")
    c.add_argument("--out", required=True, help="output directory (pattern, history, resumable checkpoint)")
    c.add_argument("--steps", type=int, default=300)
    c.add_argument("--lr", type=float, default=0.02)
    c.add_argument("--reg", type=float, default=0.05, help="weight of the L1 term mean|alpha|")
    c.add_argument("--sink", type=int, default=128, help="streaming heads' sink tokens")
    c.add_argument("--local", type=int, default=256, help="streaming heads' local window")
    c.add_argument("--min-context", type=int, default=1024)
    c.add_argument("--max-context", type=int, default=2048)
    c.add_argument("--num-passkeys", type=int, default=4)
    c.add_argument("--key-kind", default="mixed", choices=["digits", "words", "mixed"])
    c.add_argument("--batch-size", type=int, default=1)
    c.add_argument("--init", type=float, default=1.0, help="initial gate value")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--device", default="cpu")
    c.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    c.add_argument("--checkpoint-every", type=int, default=25)
    c.add_argument("--grad-checkpoint", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute layers in backward (saves memory)")
    c.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="continue from OUT/checkpoint.pt if present")
    c.add_argument("--threads", type=int, default=2, help="CPU threads (0: torch's default)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_classify_heads)

    e = sub.add_parser("eval", help="accuracy of engine configurations side by side on generated long-context tasks",
                       description="Configurations: presets (dense, static, static-random-pattern, dynamic, lserve, "
                                   "lserve-no-reuse, lserve-random-pattern, lserve-query-select), NAME@BUDGET, or "
                                   "NAME:key=value,... (keys: pattern, static_sparsity, budget, min_budget, "
                                   "reuse_interval, select_mode, dense_layers, pattern_seed, kv_quant, logical_page_size).")
    e.add_argument("--model", default="default")
    e.add_argument("--tasks", nargs="+", default=["passkey", "niah"],
                   choices=["passkey", "niah", "niah-multikey", "niah-multivalue", "vt", "cwe"])
    e.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    e.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    e.add_argument("--samples", type=int, default=1, help="prompts per (task, context, depth)")
    e.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    e.add_argument("--budget-sweep", type=_budget, nargs="*", default=None,
                   help="also run SWEEP_BASE@B for each budget B (e.g. 1/32 1/16 1/8 1/4 1/2)")
    e.add_argument("--sweep-base", default="lserve")
    e.add_argument("--haystack", default=None, choices=["sentences", "filler"], help="override each task's haystack")
    e.add_argument("--seed", type=int, default=0)
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
