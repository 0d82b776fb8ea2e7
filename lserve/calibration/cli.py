"""``lserve classify-heads``, ``calibrate-selection``, ``calibrate-prefill`` and ``calibrate-budgets``:
argparse wiring (``register(subparsers)``) of the offline tools."""

from __future__ import annotations

import argparse
import shlex
import sys

from lserve.eval.cli import budget_spec, set_threads


def cmd_classify_heads(a: argparse.Namespace) -> int:
    from lserve.calibration.classifier import GateTrainConfig, train_gates

    set_threads(a.threads, a.device)
    cfg = GateTrainConfig(model=a.model, out=a.out, steps=a.steps, lr=a.lr, reg=a.reg, sink_tokens=a.sink,
                          local_tokens=a.local, min_context=a.min_context, max_context=a.max_context,
                          num_passkeys=a.num_passkeys, key_kind=a.key_kind, objective=a.objective, loss_on=a.loss_on,
                          batch_size=a.batch_size, init=a.init,
                          seed=a.seed, device=a.device, dtype=a.dtype, checkpoint_every=a.checkpoint_every,
                          grad_checkpoint=a.grad_checkpoint, resume=a.resume,
                          extra={"command": "lserve " + shlex.join(sys.argv[1:])})
    pattern = train_gates(cfg, progress=not a.quiet)
    a_ = pattern.alphas
    print(f"wrote {a.out}/full_attention_heads.tsv ({a_.shape[0]} layers x {a_.shape[1]} KV heads); "
          f"gates < 0.5: {int((a_ < 0.5).sum())} of {a_.size}, mean {a_.mean():.3f}")
    return 0


def cmd_calibrate_selection(a: argparse.Namespace) -> int:
    from lserve.calibration.selection import CalibrationConfig, calibrate_selection

    set_threads(a.threads, a.device)
    cfg = CalibrationConfig(model=a.model, out=a.out, tasks=tuple(a.tasks), contexts=tuple(a.contexts),
                            depths=tuple(a.depths), samples=a.samples, seed=a.seed, budget=a.budget,
                            min_budget=a.min_budget, page_size=a.page_size, logical_page_size=a.logical_page_size,
                            select_mode=a.select_mode, pattern=None if a.pattern == "none" else a.pattern,
                            static_sparsity=a.static_sparsity, threshold=a.threshold, device=a.device,
                            dtype=a.dtype, extra={"command": "lserve " + shlex.join(sys.argv[1:])})
    r = calibrate_selection(cfg, progress=not a.quiet)
    print("layer  mass(min over dense heads)  mean  selects")
    for i, (m, mm) in enumerate(zip(r["layer_mass"], r["layer_mass_mean"])):
        print(f"{i:>5}  {'-' if m is None else f'{m:.3f}':>26}  {'-' if mm is None else f'{mm:.3f}':>5}  "
              f"{'yes' if i in r['select_layers'] else 'no'}")
    print(f"wrote {r['path']}: selection in {len(r['select_layers'])} of {r['layers_with_dense_heads']} layers "
          f"with dense heads (threshold {a.threshold}): {r['select_layers']}")
    return 0


def cmd_calibrate_prefill(a: argparse.Namespace) -> int:
    from lserve.calibration.prefill import PrefillCalibrationConfig, calibrate_prefill

    set_threads(a.threads, a.device)
    cfg = PrefillCalibrationConfig(model=a.model, out=a.out, tasks=tuple(a.tasks), contexts=tuple(a.contexts),
                                   depths=tuple(a.depths), samples=a.samples, seed=a.seed, target_mass=a.target_mass,
                                   pattern=None if a.pattern == "none" else a.pattern,
                                   static_sparsity=a.static_sparsity, device=a.device, dtype=a.dtype)
    r = calibrate_prefill(cfg, progress=not a.quiet)
    print("layer  tau   per KV head (dense ones starred)")
    for i, (t, hts, dense) in enumerate(zip(r["layer_taus"], r["head_taus"], r["dense_heads"])):
        print(f"{i:>5}  {t:<5g} " + " ".join(f"{x:g}{'*' if h in dense else ''}" for h, x in enumerate(hts)))
    print(f"wrote {r['path']} (target mass {a.target_mass}, {r['prompts']} prompts, {r['seconds']} s)")
    return 0


def cmd_calibrate_budgets(a: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from lserve.calibration.budgets import calibrate_budgets
    from lserve.config import ConfigError
    from lserve.sparsity.adaptive_budget import ADAPTIVE_NAME

    try:
        report = json.loads(Path(a.mass).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the selection-mass report {a.mass}: {e}") from None
    r = calibrate_budgets(report, a.context, a.mean_budget, a.method)
    r["command"] = "lserve " + shlex.join(sys.argv[1:])
    if a.out:
        out = Path(a.out)
    else:
        from lserve.sparsity.shipped import default_pattern_for

        folder = default_pattern_for(r["model_identity"]) if r.get("model_identity") else None
        if folder is None:
            raise ConfigError(f"no shipped pattern folder for model {r['model']!r} (found by the model identity "
                              f"the selection-mass report records): pass --out FILE.json")
        out = folder / ADAPTIVE_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=1) + "\n")
    print("layer  budget  ratio  mass")
    for i, (b, ratio, m) in enumerate(zip(r["budgets"], r["ratios"], r["mass"])):
        if b is not None:
            print(f"{i:>5}  {b:>6}  {ratio:>5.2f}  {m:.3f}")
    print(f"wrote {out}: mean {r['mean']} tokens per dense head (asked {a.mean_budget}), worst layer mass "
          f"{r['min_mass']} at context {a.context}")
    return 0


def register(sub) -> None:
    """Add ``classify-heads`` and the ``calibrate-*`` commands to an ``argparse`` subparsers object."""
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
    c.add_argument("--objective", default="mse", choices=["mse", "kl"],
                   help="distance between full and gated runs: final hidden states (mse) or next-token "
                        "distributions (kl)")
    c.add_argument("--loss-on", default="answer", choices=["answer", "keys"],
                   help="positions the loss compares: every answer token, or only those predicting key tokens")
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

    k = sub.add_parser("calibrate-selection", help="measure where page selection keeps the attention mass; "
                                                   "choose select_layers",
                       description="Run the model densely on generated long prompts and measure, per layer and "
                                   "KV head, the attention mass the page selector's pages hold at the given "
                                   "budget; layers whose dense heads all keep >= THRESHOLD select. Writes a "
                                   "JSON that --select-layers auto (shipped models) or --select-layers FILE uses.")
    k.add_argument("--model", default="default")
    k.add_argument("--out", default=None,
                   help="output JSON (default: selection_layers.json beside the model's shipped pattern)")
    k.add_argument("--tasks", nargs="+", default=["passkey", "niah"],
                   choices=["passkey", "niah", "niah-multikey", "niah-multivalue", "vt", "cwe"])
    k.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    k.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.75])
    k.add_argument("--samples", type=int, default=1, help="prompts per (task, context, depth)")
    k.add_argument("--seed", type=int, default=100, help="prompt seed (default: not one `lserve eval` uses)")
    k.add_argument("--budget", type=budget_spec, default="1/8", help="token count or fraction of the context")
    k.add_argument("--min-budget", type=int, default=512, help="floor of a fractional budget")
    k.add_argument("--page-size", type=int, default=64)
    k.add_argument("--logical-page-size", type=int, default=16)
    k.add_argument("--select-mode", default="kv", choices=["kv", "query"])
    k.add_argument("--pattern", default="auto", help="head pattern deciding which heads are dense ('none': all)")
    k.add_argument("--static-sparsity", type=float, default=0.5)
    k.add_argument("--threshold", type=float, default=0.9, help="minimum mean mass of every dense head of a layer")
    k.add_argument("--device", default="cpu")
    k.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    k.add_argument("--threads", type=int, default=2, help="CPU threads (0: torch's default)")
    k.add_argument("--quiet", action="store_true", help="no progress bar")
    k.set_defaults(func=cmd_calibrate_selection)

    kp = sub.add_parser("calibrate-prefill", help="per-layer thresholds of block-sparse prefill "
                                                  "(--prefill-sparsity auto)",
                        description="Prefill generated prompts densely, score each layer's key blocks with the "
                                    "engine's estimator and find, per KV head, the smallest tau whose kept tiles "
                                    "hold >= TARGET of the exact attention mass on every prompt; a layer's tau is "
                                    "the largest over its dense heads. Writes the JSON --prefill-sparsity auto reads.")
    kp.add_argument("--model", default="default")
    kp.add_argument("--out", default=None, help="output JSON (default: prefill_taus.json beside the model's "
                                                "shipped pattern)")
    kp.add_argument("--tasks", nargs="+", default=["passkey", "niah"],
                    choices=["passkey", "niah", "niah-multikey", "niah-multivalue", "vt", "cwe"])
    kp.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    kp.add_argument("--depths", type=float, nargs="+", default=[0.5])
    kp.add_argument("--samples", type=int, default=1, help="prompts per (task, context, depth)")
    kp.add_argument("--seed", type=int, default=200, help="prompt seed (default: not one `lserve eval` uses)")
    kp.add_argument("--target-mass", type=float, default=0.95, help="exact mass each dense head must keep")
    kp.add_argument("--pattern", default="auto", help="head pattern deciding which heads are dense ('none': all)")
    kp.add_argument("--static-sparsity", type=float, default=0.5)
    kp.add_argument("--device", default="cpu")
    kp.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    kp.add_argument("--threads", type=int, default=2, help="CPU threads (0: torch's default)")
    kp.add_argument("--quiet", action="store_true", help="no progress lines")
    kp.set_defaults(func=cmd_calibrate_prefill)

    cb = sub.add_parser("calibrate-budgets", help="per-layer decode budgets from a selection-mass report",
                        description="Split a mean token budget across layers from the mass curves of `lserve bench "
                                    "selection-mass` (largest worst-layer mass the mean allows, the remainder by "
                                    "mass gain per token); writes the ratios SparsityConfig.adaptive_budgets reads.")
    cb.add_argument("--mass", default="benchmarks/selection_mass/selection_mass_cpu.json", help="selection-mass report JSON")
    cb.add_argument("--context", type=int, default=8192, help="the report's context to calibrate at")
    cb.add_argument("--mean-budget", type=int, default=1024, help="mean tokens per dense head")
    cb.add_argument("--method", default="bound_p64_l16", help="curve to use (the engine's selector by default)")
    cb.add_argument("--out", default=None, help="output JSON (default: adaptive_budgets.json beside the model's "
                                                "shipped pattern)")
    cb.set_defaults(func=cmd_calibrate_budgets)
