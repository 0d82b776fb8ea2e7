"""``lserve`` command line: generate | serve | bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from lserve.config import (  # noqa: F401 - engine_config_from_args: the CLI's flags -> EngineConfig
    CacheConfig,
    ConfigError,
    EngineConfig,
    Flag,
    SparsityConfig,
    engine_config_from_args,
    engine_flags,
    parse_prefill_sparsity,
)
from lserve.serve.settings import SERVE_ENGINE_DEFAULTS, SERVE_FLAGS

DEMO_PROMPT = "The three most important ideas in computer science are"
#: Help groups of the engine flags, by the config dataclass that declares them.
_GROUPS = {EngineConfig: "engine", SparsityConfig: "sparsity", CacheConfig: "cache"}


def _parser_of(flag: Flag):
    """An argparse ``type`` for a flag with its own parser: its :class:`ConfigError` becomes argparse's
    one-line usage error."""
    def parse(text: str):
        try:
            return flag.parse(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = flag.name  # argparse names the type in its "invalid ... value" message
    return parse


def add_flags(p: argparse.ArgumentParser, flags: tuple[Flag, ...], defaults: dict | None = None) -> None:
    """One ``--flag-name`` per :class:`~lserve.config.Flag` (name, help, choices and default from the
    field that declares it; ``defaults`` overrides some), engine flags in their config's help group."""
    groups = {}
    for f in flags:
        title = _GROUPS.get(f.owner)
        if title is not None and title not in groups:
            groups[title] = p.add_argument_group(title)
        target = groups.get(title, p)
        kw: dict = {"default": (defaults or {}).get(f.name, f.default), "help": f.help}
        if f.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif f.parse is not None:
            kw["type"] = _parser_of(f)
        elif f.kind != "str":
            kw["type"] = {"int": int, "float": float}[f.kind]
        if f.choices:
            kw["choices"] = list(f.choices)
        target.add_argument("--" + f.name.replace("_", "-"), **kw)


def add_engine_args(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """Flags shared by every command that builds an engine, from the config dataclasses' metadata
    (:func:`lserve.config.engine_flags`)."""
    add_flags(p, engine_flags(), defaults)


def cmd_generate(a: argparse.Namespace) -> int:
    from lserve.engine import LLMEngine, SamplingParams

    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.sample_seed, stop=a.stop or [])
    from lserve.models.loader import load_model_config

    config = engine_config_from_args(a)
    if config.max_model_len:
        config.check_max_model_len(load_model_config(config.model))
    engine = LLMEngine(config)
    engine.add_request(a.prompt, params, chat=a.chat)
    out = None
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    if out is not None:
        m = out.metrics
        print(f"[{m['prompt_tokens']} prompt + {m['completion_tokens']} generated tokens, "
              f"finish: {out.finish_reason}, ttft {m.get('ttft_s', 0):.2f}s]", file=sys.stderr)
    return 0


def _batched(spec: str) -> tuple[int, int] | None:
    """``--batched 8x32768`` -> (8, 32768); ``none`` -> None."""
    if spec in ("none", ""):
        return None
    n, x, ctx = spec.partition("x")
    if not (x and n.isdigit() and ctx.isdigit() and int(n) >= 1 and int(ctx) >= 16):
        raise ConfigError(f"--batched must look like 8x32768 (sequences x context) or none, got {spec!r}")
    return int(n), int(ctx)


def cmd_bench(a: argparse.Namespace) -> int:
    if a.what == "cpu":
        from lserve.bench.cpu import run_cpu_bench

        run_cpu_bench(a.out, prompt_lens=a.prompt_lens, decode_tokens=a.decode_tokens or 32)
    elif a.what == "e2e":
        from lserve.bench.e2e import run_e2e_bench

        run_e2e_bench(a.out, model=a.model or "llama3-8b", device=a.device or "cuda", backend=a.backend or "cupy",
                      contexts=a.contexts or [8192, 32768, 65536, 131072, 262144],
                      decode_steps=a.decode_tokens or 64, hf=not a.no_hf, name=a.name or "e2e_h200",
                      batched=_batched(a.batched), side_max_context=a.side_max_context, deadline_s=a.deadline,
                      async_decode=a.async_decode, prefill_sparsity=tuple(a.prefill_sparsity or ()),
                      adaptive_budgets=a.adaptive_budgets)
    elif a.what == "sparse-prefill":
        from lserve.bench.sparse_prefill import CONTEXTS, TAUS, run

        run(a.out, contexts=a.contexts or CONTEXTS, taus=a.prefill_sparsity or TAUS, name=a.name or "sparse_prefill_h200")
    elif a.what == "profile-threshold":
        import torch

        from lserve.bench.threshold import run_profile_threshold

        device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
        gpu = device.startswith("cuda")
        if a.budget < 128:
            raise ConfigError(f"--budget must be at least two pages (128 tokens), got {a.budget}")
        run_profile_threshold(model=a.model or ("llama3-8b" if gpu else "default"), device=device,
                              backend=a.backend or ("cupy" if gpu else "torch"), budget=a.budget,
                              contexts=a.contexts, decode_steps=a.decode_tokens or 32, out_dir=a.out, name=a.name,
                              profile_file=a.profile_file, save=not a.no_save)
    elif a.what == "profile-prefill-threshold":
        import torch

        from lserve.bench.prefill_threshold import TAU, run_prefill_threshold

        device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
        gpu = device.startswith("cuda")
        taus = a.prefill_sparsity or [TAU]
        if len(taus) != 1 or not (0 < taus[0] < 1 or taus[0] == -1):
            raise ConfigError(f"profile-prefill-threshold takes one --prefill-sparsity in (0, 1) or auto, got {taus}")
        run_prefill_threshold(model=a.model or ("llama3-8b" if gpu else "default"), device=device,
                              backend=a.backend or ("cupy" if gpu else "torch"), tau=taus[0], contexts=a.contexts,
                              out_dir=a.out, name=a.name, profile_file=a.profile_file, save=not a.no_save)
    elif a.what == "selection-mass":
        from lserve.bench.selection_mass import SelectionMassConfig, run_selection_mass

        if a.device is None or a.device == "cpu":
            import torch

            torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
        run_selection_mass(SelectionMassConfig(model=a.model or "default", device=a.device or "cpu",
                                               contexts=tuple(a.contexts or (2048, 4096, 8192)),
                                               decode_steps=a.decode_tokens or 8, budgets=tuple(a.budgets),
                                               depths=tuple(a.depths)),
                           a.out, name=a.name or "selection_mass_cpu")
    elif a.what == "prefill-sparsity":
        from lserve.bench.prefill_sparsity import CONTEXTS, Q_BLOCK, STRIDE, run_prefill_sparsity

        run_prefill_sparsity(a.out, contexts=tuple(a.contexts or CONTEXTS), model=a.model or "default",
                             name=a.name or "prefill_sparsity_cpu", q_block=a.q_block or Q_BLOCK,
                             stride=a.stride or STRIDE)
    elif a.what == "kernels":
        from lserve.bench.kernels import run_kernel_bench

        run_kernel_bench(a.out, model=a.model or "llama3-8b")
    elif a.what == "serve":
        from lserve.bench.serve import merge_reports, run_serve_bench

        if a.merge:
            merge_reports(a.merge, a.out, a.name or "serve_h200")
            return 0
        from lserve.bench.serve import CONFIG_FLAGS, parse_plan

        configs = tuple(a.configs.split(","))
        sweep_configs = tuple(a.sweep_configs.split(",")) if a.sweep_configs else configs
        for flag, names in (("--configs", configs), ("--sweep-configs", sweep_configs)):
            bad = [c for c in names if c not in CONFIG_FLAGS]
            if bad:
                raise ConfigError(f"{flag}: unknown configuration {bad[0]!r} (choose from {', '.join(CONFIG_FLAGS)})")
        try:
            plan = parse_plan(a.plan or [], a.decode_tokens or 64)
        except ValueError as e:
            raise ConfigError(f"--plan: {e}") from None
        if a.point_time < 0 or a.requests_per_c < 1 or a.slo_ttft_ms <= 0 or a.slo_itl_ms <= 0:
            raise ConfigError("--point-time must be >= 0, --requests-per-c >= 1, --slo-ttft-ms and --slo-itl-ms > 0")
        if a.decode_step_min_c < 1:
            raise ConfigError(f"--decode-step-min-c must be >= 1 (--no-decode-step: none), got {a.decode_step_min_c}")
        if any(v < 1 for v in a.stream_intervals or ()):
            raise ConfigError(f"--stream-intervals values must be >= 1, got {a.stream_intervals}")
        if any(v < 0 for v in a.itl_slo_sweep or ()):
            raise ConfigError("--itl-slo-sweep values must be >= 0 ms (0: no ITL SLO)")
        if a.sweep_point is not None and not (len(a.sweep_point.split(":")) == 2
                                              and all(x.isdigit() for x in a.sweep_point.split(":"))):
            raise ConfigError(f"--sweep-point must look like 131072:4 (context:concurrency), got {a.sweep_point!r}")
        contexts = tuple(a.contexts or (2048, 32768, 131072))
        planned = {ctx for _, ctx, _, _ in plan} or set(contexts)
        run_serve_bench(a.out, name=a.name or "serve_h200", model=a.model or "llama3-8b", device=a.device or "cuda",
                        backend=a.backend or "cupy", contexts=contexts,
                        output_len=a.decode_tokens or 64, deadline_s=a.deadline, point_time_s=a.point_time,
                        prefix_contexts=tuple(a.prefix_contexts or ()),
                        extra_flags=tuple(f for fl in a.server_flags for f in fl.split()),
                        configs=configs, engine_contexts=tuple(sorted(c for c in planned if c >= 32768 and a.engine_ttft)),
                        workload=a.workload, plan=tuple(a.plan or ()), requests_per_c=a.requests_per_c,
                        point_limit_s=a.point_limit, slo_ttft_ms=a.slo_ttft_ms, slo_itl_ms=a.slo_itl_ms,
                        itl_slo_sweep=tuple(a.itl_slo_sweep or ()), sweep_point=a.sweep_point, port=a.port,
                        decode_step_min_c=a.decode_step_min_c if a.decode_step else None, sweep_configs=sweep_configs,
                        stream_intervals=tuple(a.stream_intervals or ()))
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    try:
        from lserve.serve.app import serve_main
    except ImportError as e:
        raise ConfigError(f"serving needs the 'serve' extra (pip install -e '.[serve]'): {e}") from None
    return serve_main(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lserve", description="Long-context LLM serving with block-sparse attention")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    g.add_argument("prompt", nargs="?", default=DEMO_PROMPT)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sample-seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=False,
                   help="wrap the prompt in the model's chat template")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmarks that write JSON + PNG under benchmarks/")
    b.add_argument("what", choices=["cpu", "kernels", "e2e", "profile-threshold", "profile-prefill-threshold", "serve",
                                      "selection-mass", "prefill-sparsity", "sparse-prefill"])
    b.add_argument("--out", default="benchmarks")
    b.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 4096], help="cpu: prompt lengths")
    b.add_argument("--decode-tokens", type=int, default=None,
                   help="decode steps measured per point (default 64 for e2e, 8 for selection-mass, else 32; serve: tokens "
                        "per request)")
    b.add_argument("--model", default=None,
                   help="e2e / profile-threshold: model or preset (default llama3-8b on a GPU, else default); "
                        "kernels: the preset whose attention layer is timed (default llama3-8b)")
    b.add_argument("--device", default=None, help="e2e (default cuda) / profile-threshold (default: cuda if present)")
    b.add_argument("--backend", default=None, choices=["torch", "cupy"],
                   help="attention backend (default cupy on a GPU, torch on a CPU)")
    b.add_argument("--contexts", type=int, nargs="+", default=None,
                   help="e2e (default 8k..256k) / profile-threshold (default multiples of the budget)")
    b.add_argument("--no-hf", action="store_true", help="e2e: skip the transformers peer")
    b.add_argument("--prefill-sparsity", type=parse_prefill_sparsity, nargs="+", default=None, metavar="TAU",
                   help="e2e: also LServe with block-sparse prefill at each tau; sparse-prefill: the taus "
                        "(default 0.75 0.5 0.25 0.1); profile-prefill-threshold: the one tau, or auto (the "
                        "default: the model's shipped per-layer taus)")
    b.add_argument("--adaptive-budgets", default=None, metavar="auto|resampled|PATH",
                   help="e2e: also LServe with per-layer decode budgets of the same mean (lserve-adaptive): the "
                        "model's shipped calibration, the default model's resampled to this model's layers, or a "
                        "calibration .json")
    b.add_argument("--batched", default="8x32768", help="e2e: the batched decode point, SEQSxCONTEXT or none")
    b.add_argument("--side-max-context", type=int, default=None,
                   help="e2e: longest context for the static-only and dynamic-only configurations")
    b.add_argument("--deadline", type=float, default=None,
                   help="e2e / serve: seconds after which remaining runs are skipped (listed in the report)")
    b.add_argument("--async-decode", action=argparse.BooleanOptionalAction, default=True,
                   help="e2e: engines launch each decode step before reading the previous one's tokens")
    b.add_argument("--name", default=None, help="output file stem")
    b.add_argument("--budget", type=int, default=4096, help="profile-threshold: token budget")
    b.add_argument("--profile-file", default=None,
                   help="profile-threshold / profile-prefill-threshold: where to save (default "
                        "$LSERVE_CACHE_DIR/dynamic_threshold.json / prefill_threshold.json)")
    b.add_argument("--no-save", action="store_true",
                   help="profile-threshold / profile-prefill-threshold: measure and report only")
    b.add_argument("--configs", default="lserve,dense", help="serve: configurations, comma-separated")
    b.add_argument("--engine-ttft", action=argparse.BooleanOptionalAction, default=True,
                   help="serve: time the engine's own one-step TTFT at the contexts >= 32k first")
    b.add_argument("--decode-step", action=argparse.BooleanOptionalAction, default=True,
                   help="serve: time the engine's pure decode step at each point's context and concurrency first (the "
                        "d of bound_tok_s; --no-decode-step: no bound)")
    b.add_argument("--decode-step-min-c", type=int, default=1, metavar="C",
                   help="serve: time the decode step only for points of at least this concurrency")
    b.add_argument("--server-flags", action="append", default=[],
                   help="serve: more `lserve serve` flags for every configuration, one string (e.g. \"--itl-slo-ms 50\"); "
                        "may be given more than once")
    b.add_argument("--point-time", type=float, default=30.0,
                   help="serve: seconds a load point sends for at least (then its requests in flight finish)")
    b.add_argument("--requests-per-c", type=int, default=8,
                   help="serve: requests a load point sends at least, per client")
    b.add_argument("--point-limit", type=float, default=600.0,
                   help="serve: seconds after which a load point's requests in flight are cancelled")
    b.add_argument("--workload", default="random", choices=["random", "doc-qa", "reasoning", "chat"],
                   help="serve: random (--decode-tokens out), doc-qa (long in, 128 out), reasoning (long in, 2048 out), "
                        "chat (multi-turn, 256 out)")
    b.add_argument("--plan", nargs="+", default=None, metavar="WORKLOAD:CONTEXT:C1,C2[:OUT]",
                   help="serve: load points instead of --contexts/--workload, e.g. reasoning:131072:4 random:2048:1,16,32:512")
    b.add_argument("--slo-ttft-ms", type=float, default=30000.0, help="serve: TTFT SLO of the goodput column")
    b.add_argument("--slo-itl-ms", type=float, default=200.0,
                   help="serve: ITL SLO of the goodput column (a request's worst gap between tokens)")
    b.add_argument("--itl-slo-sweep", type=float, nargs="+", default=None, metavar="MS",
                   help="serve: after the plan, serve --sweep-point once per --itl-slo-ms value (0: none), per "
                        "configuration, and plot TTFT p50 against ITL p99 (<name>_itl_slo.png)")
    b.add_argument("--sweep-configs", default=None,
                   help="serve: configurations the ITL SLO sweep serves, comma-separated (default: --configs); a plan "
                        "entry at the sweep point is already its point at the default SLO")
    b.add_argument("--sweep-point", default=None, metavar="CONTEXT:C",
                   help="serve: the sweep's load point (default: the longest context at concurrency 4)")
    b.add_argument("--stream-intervals", type=int, nargs="+", default=None, metavar="N",
                   help="serve: serve each configuration's plan once per `lserve serve --stream-interval` value "
                        "(e.g. 1 4: tokens per streamed chunk); rows record theirs")
    b.add_argument("--port", type=int, default=8321, help="serve: the port of the servers it starts")
    b.add_argument("--prefix-contexts", type=int, nargs="+", default=None,
                   help="serve: also time a first and a second question on one document of each length (LServe)")
    b.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="serve: join the reports of several runs into --out/--name (.json + .png), measuring nothing")
    b.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                   help="selection-mass: token budgets of the table and plot")
    b.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.75],
                   help="selection-mass: needle depths of the prompts")
    b.add_argument("--q-block", type=int, default=None,
                   help="prefill-sparsity: query positions per row (default: the lserve-prefill-sparse preset's)")
    b.add_argument("--stride", type=int, default=None,
                   help="prefill-sparsity: antidiagonal stride (default: SparsityConfig.prefill_stride)")
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("serve", help="OpenAI-compatible server (Ray Serve)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(s, SERVE_FLAGS)
    add_engine_args(s, SERVE_ENGINE_DEFAULTS)  # serving: one GPU per replica when there is one
    s.set_defaults(func=cmd_serve)

    from lserve.serve.drain import register as register_drain

    register_drain(sub)

    from lserve.calibration.cli import register as register_calibration  # classify-heads, calibrate-*
    from lserve.eval.cli import register as register_eval

    register_calibration(sub)
    register_eval(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("LSERVE_LOG", "WARNING"))
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"lserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        # imported here: it loads torch, which commands such as `lserve drain` (a preStop hook) do without
        from lserve.engine.llm_engine import RequestError

        if not isinstance(e, RequestError):
            raise
        print(f"lserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
