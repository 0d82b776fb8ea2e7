"""``lserve`` command line: generate | serve | bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from lserve.config import (  # noqa: F401 - engine_config_from_args: the CLI's flags -> EngineConfig
    PREFILL_ESTIMATORS,
    ConfigError,
    SparsityConfig,
    engine_config_from_args,
    engine_flag_defaults,
)
from lserve.serve.settings import DEFAULT_SHUTDOWN_GRACE_S, DEFAULT_SSE_KEEPALIVE_S

DEMO_PROMPT = "The three most important ideas in computer science are"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine (defaults: :func:`engine_flag_defaults`)."""
    D = engine_flag_defaults()
    g = p.add_argument_group("model")
    g.add_argument("--model", default=D["model"],
                   help="'default' (SmolLM2-135M-Instruct), a preset (llama3-8b, llama2-7b, minitron-4b, "
                        "qwen2.5-7b, qwen3-8b, mistral-7b, tiny), "
                        "a .gguf file or a Hugging Face directory")
    g.add_argument("--device", default=D["device"], help="cpu or cuda[:N]")
    g.add_argument("--dtype", default=D["dtype"], choices=["auto", "float32", "float16", "bfloat16"],
                   help="activations and KV cache (auto: float32 on a CPU, bfloat16 on a GPU)")
    g.add_argument("--backend", default=D["backend"], choices=["torch", "cupy"], help="attention backend")
    g.add_argument("--max-model-len", type=int, default=D["max_model_len"], help="context limit (0: the model's)")
    g.add_argument("--allow-long-max-model-len", action="store_true", default=D["allow_long_max_model_len"],
                   help="accept a --max-model-len past the model's context (its trained length, stretched by its "
                        "rope scaling), whose outputs there are unreliable")
    g.add_argument("--max-num-seqs", type=int, default=D["max_num_seqs"], help="sequences decoded together at most")
    g.add_argument("--max-batched-tokens", type=int, default=D["max_batched_tokens"],
                   help="token-equivalents per step at most (long prompts are prefilled in chunks)")
    g.add_argument("--step-time-target", type=float, default=D["step_time_target"],
                   help="seconds a step with prefill should take, from measured speed (0: token cap only)")
    g.add_argument("--itl-slo-ms", type=float, default=D["itl_slo_ms"],
                   help="ms a step that carries decodes may take (the ITL of running requests while prompts are "
                        "prefilled); prefill gets the rest, never less than --min-prefill-share (0: the step target)")
    g.add_argument("--min-prefill-share", type=float, default=D["min_prefill_share"],
                   help="least fraction of the time of steps with decodes that prefill gets (at its own speed), "
                        "however many requests decode")
    g.add_argument("--seed", type=int, default=D["seed"], help="seed for random-weight presets")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=D["cuda_graphs"],
                   help="replay decode steps as CUDA graphs (cupy backend)")
    g.add_argument("--fused-ops", action=argparse.BooleanOptionalAction, default=D["fused_ops"],
                   help="fused CUDA kernels for RMSNorm/RoPE/SiLU (cupy backend; self-checked at start)")
    g.add_argument("--async-decode", action=argparse.BooleanOptionalAction, default=D["async_decode"],
                   help="launch each greedy decode step before reading the previous one's tokens (same outputs)")
    s = p.add_argument_group("sparsity")
    s.add_argument("--pattern", default=D["pattern"],
                   help="head pattern: 'auto' (the model's shipped learned pattern, if any), 'none', 'random' "
                        "or a DuoAttention-format dir/TSV")
    s.add_argument("--static-sparsity", type=float, default=D["static_sparsity"], help="fraction of KV heads made streaming")
    s.add_argument("--sink", type=int, default=D["sink"], help="streaming heads: sink tokens")
    s.add_argument("--local", type=int, default=D["local"], help="streaming heads: local window tokens")
    s.add_argument("--token-budget", type=int, default=D["token_budget"], help="dense heads' decode budget (0: off)")
    s.add_argument("--reuse-interval", type=int, default=D["reuse_interval"], help="run the page selector every C steps")
    s.add_argument("--dynamic-threshold", type=int, default=D["dynamic_threshold"],
                   help="context below which selection is off (-1: the profiled length for this device, "
                        "see lserve bench profile-threshold)")
    s.add_argument("--dense-layers", type=int, default=D["dense_layers"], help="first N layers stay fully dense")
    s.add_argument("--select-mode", default=D["select_mode"], choices=["kv", "query"],
                   help="dynamic selection once per KV head (kv) or per query head (query)")
    s.add_argument("--select-layers", default=D["select_layers"],
                   help="layers where dense heads select pages: 'auto' (the model's shipped calibration, see "
                        "lserve calibrate-selection; else all), 'all', 'none', indices '0,5,7' or a calibration .json")
    s.add_argument("--adaptive-budgets", default=D["adaptive_budgets"],
                   help="per-layer decode budgets around the mean --token-budget: 'auto' (the model's shipped "
                        "calibration, see lserve calibrate-budgets), a calibration .json, or '' (off)")
    s.add_argument("--prefill-sparsity", type=_prefill_tau, default=D["prefill_sparsity"],
                   help="dynamic block-sparse prefill of dense heads: estimated attention mass each query "
                        "block keeps, in [0, 1] (0: off; torch and cupy backends), or 'auto': per-layer values "
                        "calibrated for the model (lserve calibrate-prefill; off when none ships)")
    s.add_argument("--prefill-sparsity-min-len", type=int, default=D["prefill_sparsity_min_len"],
                   help="context (cached + chunk tokens) from which a prefill chunk is block-sparse "
                        "(-1: auto, from lserve bench profile-prefill-threshold's profile of this device)")
    s.add_argument("--prefill-block", type=int, default=D["prefill_block"],
                   help="block-sparse prefill: tokens per key block")
    s.add_argument("--prefill-q-block", type=int, default=D["prefill_q_block"],
                   help="block-sparse prefill: query positions sharing one block list (a multiple of --prefill-block)")
    s.add_argument("--prefill-estimator", default=D["prefill_estimator"], choices=list(PREFILL_ESTIMATORS),
                   help="block-sparse prefill: how a block's attention mass is estimated")
    c = p.add_argument_group("cache")
    c.add_argument("--page-size", type=int, default=D["page_size"], help="physical page N_P")
    c.add_argument("--logical-page-size", type=int, default=D["logical_page_size"], help="logical page N_L")
    c.add_argument("--kv-quant", default=D["kv_quant"], choices=["none", "int8", "int4"], help="KV cache quantization")
    c.add_argument("--max-cache-tokens", type=int, default=D["max_cache_tokens"], help="dense-pool capacity in tokens")
    c.add_argument("--host-kv-gib", type=float, default=D["host_kv_gib"],
                   help="host memory for dense heads' KV pages past the --max-cache-tokens resident on the device "
                        "(torch backend; 0: off)")
    c.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=D["prefix_cache"],
                   help="reuse the KV pages of prompt prefixes seen before (--no-prefix-cache: recompute every prompt)")


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


def _prefill_tau(spec: str) -> float:
    """``--prefill-sparsity``: a number (its range is the config's to check), or "auto"."""
    try:
        return SparsityConfig.parse_prefill_sparsity(spec)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
        if len(taus) != 1 or not 0 < taus[0] < 1:
            raise ConfigError(f"profile-prefill-threshold takes one --prefill-sparsity in (0, 1), got {taus}")
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
        bad = [c for c in configs if c not in CONFIG_FLAGS]
        if bad:
            raise ConfigError(f"--configs: unknown configuration {bad[0]!r} (choose from {', '.join(CONFIG_FLAGS)})")
        try:
            plan = parse_plan(a.plan or [], a.decode_tokens or 64)
        except ValueError as e:
            raise ConfigError(f"--plan: {e}") from None
        if a.point_time < 0 or a.requests_per_c < 1 or a.slo_ttft_ms <= 0 or a.slo_itl_ms <= 0:
            raise ConfigError("--point-time must be >= 0, --requests-per-c >= 1, --slo-ttft-ms and --slo-itl-ms > 0")
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
                        prefix_contexts=tuple(a.prefix_contexts or ()), extra_flags=tuple(a.server_flags.split()),
                        configs=configs, engine_contexts=tuple(sorted(c for c in planned if c >= 32768 and a.engine_ttft)),
                        workload=a.workload, plan=tuple(a.plan or ()), requests_per_c=a.requests_per_c,
                        point_limit_s=a.point_limit, slo_ttft_ms=a.slo_ttft_ms, slo_itl_ms=a.slo_itl_ms,
                        itl_slo_sweep=tuple(a.itl_slo_sweep or ()), sweep_point=a.sweep_point, port=a.port)
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
    b.add_argument("--prefill-sparsity", type=float, nargs="+", default=None, metavar="TAU",
                   help="e2e: also LServe with block-sparse prefill at each tau; sparse-prefill: the taus "
                        "(default 0.75 0.5 0.25 0.1); profile-prefill-threshold: the one tau (default 0.9)")
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
    b.add_argument("--server-flags", default="",
                   help="serve: more `lserve serve` flags for every configuration, one string (e.g. \"--itl-slo-ms 50\")")
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
    b.add_argument("--sweep-point", default=None, metavar="CONTEXT:C",
                   help="serve: the sweep's load point (default: the longest context at concurrency 4)")
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
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible API")
    s.add_argument("--replicas", type=int, default=1, help="engine replicas (the initial count with --autoscaling)")
    s.add_argument("--autoscaling", action="store_true",
                   help="let Ray Serve scale engine replicas between --min-replicas and --max-replicas")
    s.add_argument("--min-replicas", type=int, default=1, help="with --autoscaling: fewest engine replicas")
    s.add_argument("--max-replicas", type=int, default=1, help="with --autoscaling: most engine replicas")
    s.add_argument("--max-ongoing-requests", type=int, default=0,
                   help="requests one engine replica holds at once (0: 2 x --max-num-seqs)")
    s.add_argument("--max-queued-requests", type=int, default=64,
                   help="requests admitted beyond what the replicas hold; more get 429 + Retry-After")
    s.add_argument("--served-model-name", default=None, help="model id in the API (default: the --model value)")
    s.add_argument("--shutdown-grace-s", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                   help="on Ctrl-C/SIGTERM: refuse new requests (503), give running ones this long to finish, "
                        "then end them with an error event")
    s.add_argument("--sse-keepalive-s", type=float, default=DEFAULT_SSE_KEEPALIVE_S,
                   help="a stream silent this long (queued, prefilling) sends an SSE comment line ': keep-alive' "
                        "(0: never)")
    add_engine_args(s)
    s.set_defaults(func=cmd_serve, device="auto")  # serving: one GPU per replica when there is one

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
