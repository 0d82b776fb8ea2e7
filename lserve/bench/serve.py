"""``lserve bench serve``: the Ray Serve app under load, LServe beside the dense configuration.

For each configuration a real ``lserve serve`` process is started (Ray Serve, the OpenAI
ingress, one engine replica) and driven through HTTP by ``load_tests`` (streaming
``/v1/completions``, closed-loop clients, exactly ``output_len`` tokens per request), as
``vllm bench serve`` measures a server: TTFT, ITL and output tokens/s per (workload, context,
concurrency). A load point sends for at least ``point_time_s`` (30 s by default) and at least
``requests_per_c`` (8) requests per client, then lets the requests in flight finish. Workloads
(:data:`WORKLOADS`): ``random`` (``--decode-tokens`` per request), ``doc-qa`` (a long document and
question, 128 output tokens), ``reasoning`` (a long prompt, 2048 output tokens), ``chat``
(multi-turn: each turn resends the history, 256 output tokens). Each row also has
``bound_tok_s`` (:func:`bound_tok_s`), the SLOs it was judged against (``slo``) and its goodput.
Also, per run:

* ``engine_ttft_s``: the engine's own TTFT of the LServe configuration at the long contexts
  (``lserve bench e2e``'s measurement, whole prompt in one step, the second prompt of its length,
  same process, before any server starts); ``engine_ttft_by_config``: the same per served
  configuration but dense;
* ``decode_step_ms``: per configuration, context and concurrency, the engine's pure decode step
  of that batch (:mod:`lserve.bench.decode_step`, timed before any server starts; only points
  with ``C >= --decode-step-min-c``), the ``d`` of each row's ``bound_tok_s``;
* ``hol``: a short request sent while the LServe server prefills a long prompt, against the same
  short request alone (head-of-line blocking); ``hol_repeat``: the same probe again on that server
  (the first probe is the first long prompt the server prefills);
* ``prefix_cache`` (``--prefix-contexts``): per context, the TTFT of a first and a second question
  on one document and the prompt tokens the second got from the prefix cache (also written as
  the ``rows`` of ``<prefix_name>.json``);
* ``steps``: per configuration, how the engine ran its steps (CUDA-graph replays, eager decode
  steps, steps with prefill), read from ``/admin/engines`` after the load;
* ``stream_interval`` of each row: the servers' ``--stream-interval`` (``--stream-intervals 1 4``
  serves every configuration once per value); a row's ITL is then the gap between streamed chunks,
  as ``vllm bench serve`` counts it, its TPOT and throughput per token (usage), and
  ``tokens_per_chunk`` says how many tokens a chunk carried;
* ``itl_sweep`` (``--itl-slo-sweep``): rows of one (workload, context, concurrency) point served
  with each ``--itl-slo-ms`` value, per configuration, plotted as TTFT p50 against ITL p99
  (``<name>_itl_slo.png``): the trade-off the SLO sets.

The JSON is rewritten after every point, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from lserve.bench.report import header, write_json
from lserve.bench.serve_plots import plot_itl_sweep, plot_serve
from lserve.bench.serve_readings import (
    REPLICA_ITL,
    REPLICA_SIDE,
    histogram_totals,
    replica_means,
    share_above,
    step_line,
    step_time,
)
from lserve.bench.serve_server import Server, auth_headers, dump_stacks
from lserve.serve.settings import API_KEY_ENV, DEFAULT_STREAM_INTERVAL

# On random weights tau sets how much of the causal prefill the dense heads keep (0.237 at 128k
# and 0.209 at 256k for 0.2, benchmarks/e2e/e2e_ttft_h200.json), not an accuracy-checked setting.
SPARSE_TAU = 0.2
_LSERVE_FLAGS = ["--pattern", "random", "--static-sparsity", "0.5", "--token-budget", "4096"]
CONFIG_FLAGS = {
    "lserve": _LSERVE_FLAGS,
    "lserve-sparse": [*_LSERVE_FLAGS, "--prefill-sparsity", str(SPARSE_TAU)],
    "dense": ["--pattern", "none", "--token-budget", "0"],
}


def engine_sparsity(config: str):
    """The :class:`~lserve.config.SparsityConfig` that ``lserve bench e2e`` times for a served configuration."""
    from lserve.bench.e2e import CONFIGS, prefill_sparse_configs

    if config == "lserve-sparse":
        return next(iter(prefill_sparse_configs((SPARSE_TAU,)).values()))
    return CONFIGS[config]
SHORT_LEN = 256  # the head-of-line probe's short prompt
HOL_OUTPUT = 8  # tokens each of its requests generates
HOL_MIN_CONTEXT = 32768  # the probe runs when the plan reaches this context (its long prompt: the longest)
#: Workload -> output tokens per request (None: ``--decode-tokens``).
WORKLOADS = {"random": None, "doc-qa": 128, "reasoning": 2048, "chat": 256}
CHAT_TURNS = 4  # turns per conversation of the chat workload (its last turn is ``context`` tokens long)


def parse_plan(items: list[str], default_output: int) -> list[tuple[str, int, list[int], int]]:
    """``WORKLOAD:CONTEXT:C1,C2[:OUTPUT]`` strings -> (workload, context, concurrencies, output_len).

    Raises
    ------
    ValueError
        For a malformed entry, an unknown workload or a count below 1.
    """
    out = []
    for item in items:
        parts = item.split(":")
        if len(parts) not in (3, 4) or parts[0] not in WORKLOADS:
            raise ValueError(f"a plan entry is WORKLOAD:CONTEXT:C1,C2[:OUTPUT] with WORKLOAD one of "
                             f"{', '.join(WORKLOADS)}; got {item!r}")
        try:
            ctx, concs = int(parts[1]), [int(c) for c in parts[2].split(",")]
            output = int(parts[3]) if len(parts) == 4 else (WORKLOADS[parts[0]] or default_output)
        except ValueError:
            raise ValueError(f"plan entry {item!r}: context, concurrencies and output must be integers") from None
        if ctx < 16 or output < 1 or min(concs) < 1:
            raise ValueError(f"plan entry {item!r}: context must be >= 16, output and concurrencies >= 1")
        out.append((parts[0], ctx, concs, output))
    return out


@dataclass(frozen=True)
class ServerSize:
    """How the bench sizes every server it starts: for its longest request, its largest load point
    (cache and sequences), the prefix probe's document and question, and the head-of-line probe's
    long and short requests running at once (``hol_context``: its long prompt, 0 when it does not run)."""

    max_model_len: int
    cache_tokens: int
    max_num_seqs: int
    hol_context: int


def server_size(points: list[tuple[str, int, list[int], int]], prefix_contexts, hol: bool) -> ServerSize:
    """:class:`ServerSize` of a plan (``(workload, context, concurrencies, output_len)`` entries)."""
    contexts = {p[1] for p in points}
    longest = max((*contexts, *prefix_contexts))
    max_c = max(max(p[2]) for p in points)
    cache = max(max(c * (ctx + out + 64) for c in cs) for _, ctx, cs, out in points)
    cache = max([cache] + [2 * ctx + 1024 for ctx in prefix_contexts])  # a document + a question
    hol_context = max(contexts) if hol and max(contexts) >= HOL_MIN_CONTEXT else 0
    if hol_context:  # a server of one sequence would queue the short request behind the long one
        max_c = max(max_c, 2)
        cache = max(cache, hol_context + SHORT_LEN + 2 * (HOL_OUTPUT + 64))
    return ServerSize(longest + max(p[3] for p in points) + 64, cache, max_c, hol_context)


def bound_tok_s(rows: list[dict], engine_ttft: dict | None = None, decode_step_ms: dict | None = None) -> None:
    """Set each row's ``bound_tok_s`` (and ``decode_step_ms``): the output tokens/s its closed loop
    could reach at most on this server, from the prefill time and the pure decode step.

    One GPU does one thing at a time, so a round of ``C`` requests of ``n`` output tokens takes at
    least ``C * P + (n - 1) * d``: each prompt's prefill ``P``, and ``n - 1`` decode steps of the
    batch of ``C``, ``d`` each (a step of fewer sequences costs less but yields fewer tokens:
    full batches are the cheapest way to ``C * (n - 1)`` tokens; a step that decodes and
    prefills runs the decodes' forward beside the chunk's, so folding saves no decode time).
    ``d`` is the pure decode step at batch ``C`` and the row's context
    (``decode_step_ms[config][context][C]``, :func:`lserve.bench.decode_step.decode_step_s`),
    never a served ITL, whose mixed steps would make the bound no bound. ``P`` is the smaller
    of the TTFT p50 of the concurrency-1 row of the same (configuration, workload, context,
    output) and the engine's own one-step TTFT at that context. Hence
    ``bound = C * n / (C * P + (n - 1) * d)``; None where ``P`` or ``d`` is missing.
    """
    def key(r: dict) -> tuple:
        return r["config"], r.get("workload"), r["context"], r["output_len"], r.get("stream_interval", 1)

    alone = {key(r): r["ttft_p50_s"] for r in rows if r["concurrency"] == 1 and r.get("ttft_p50_s")}
    for r in rows:
        ps = [alone.get(key(r)),
              (engine_ttft or {}).get(r["config"], {}).get(str(r["context"]))]
        p = min((x for x in ps if x), default=None)
        d = (decode_step_ms or {}).get(r["config"], {}).get(str(r["context"]), {}).get(str(r["concurrency"]))
        r["decode_step_ms"] = d
        c, n = r["concurrency"], r["output_len"]
        r["bound_tok_s"] = None if p is None or not d else round(c * n / (c * p + (n - 1) * d / 1e3), 2)


def _log(msg: str) -> None:
    print(f"[bench serve {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _tokenizer(vocab: int):
    from load_tests.datasets import load_tokenizer

    return load_tokenizer(f"preset:{vocab}")


def _last_flag(flags: list[str], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` or ``flag=VALUE`` in ``flags`` (None: not given)."""
    value = None
    for i, f in enumerate(flags):
        if f == flag and i + 1 < len(flags):
            value = flags[i + 1]
        elif f.startswith(flag + "="):
            value = f.split("=", 1)[1]
    return value


def served_itl_slo_ms(flags: list[str]) -> float:
    """The ``--itl-slo-ms`` a server started with ``flags`` runs with (the last one given, else the default)."""
    from lserve.config import engine_flag_defaults

    value = _last_flag(flags, "--itl-slo-ms")
    return float(value) if value is not None else float(engine_flag_defaults()["itl_slo_ms"])


def served_stream_interval(flags: list[str]) -> int:
    """The ``--stream-interval`` a server started with ``flags`` runs with (the last one given, else the default)."""
    value = _last_flag(flags, "--stream-interval")
    return int(value) if value is not None else DEFAULT_STREAM_INTERVAL


def workload_specs(tok, workload: str, context: int, num: int, output_len: int, seed: int):
    """The requests of a load point: ``num`` prompts of ``context`` tokens (chat: conversations
    whose last turn is ``context`` tokens long, ``num`` turns in all)."""
    from load_tests.datasets import chat_dataset, random_dataset

    if workload != "chat":
        return random_dataset(tok, num, context, output_len, 0.0, seed)
    user = min(64, max(1, context // 16))
    system = max(0, context - CHAT_TURNS * user - (CHAT_TURNS - 1) * output_len)
    return chat_dataset(tok, -(-num // CHAT_TURNS), CHAT_TURNS, system, user, output_len, output_len, 0.0, seed)


def run_point(base_url: str, tok, context: int, concurrency: int, output_len: int, time_limit_s: float,
              seed: int = 0, workload: str = "random", min_time_s: float = 30.0, requests_per_c: int = 8,
              slos_ms: dict | None = None) -> dict:
    """One closed-loop load point through ``load_tests``: it sends for ``min_time_s`` and at least
    ``requests_per_c * concurrency`` requests, then lets those in flight finish (all within
    ``time_limit_s``); its ``results`` summary, goodput under ``slos_ms``."""
    from load_tests.client import RequestOptions
    from load_tests.runner import LoadShape, run_load
    from load_tests.stats import summarize

    least = requests_per_c * concurrency
    pool = least if context > 4096 else max(least, 64 * concurrency)  # short requests: enough for min_time_s
    specs = workload_specs(tok, workload, context, pool, output_len, seed)
    # the servers this bench starts inherit its environment, an API key included
    opts = RequestOptions(url=base_url + "/v1/completions", model=None, temperature=0.0, ignore_eos=True,
                          timeout_s=time_limit_s + 60, api_key=os.environ.get(API_KEY_ENV))
    shape = LoadShape("concurrency", concurrency=concurrency, seed=seed)
    results, duration, _ = asyncio.run(run_load(specs, opts, shape, time_limit_s, progress=False,
                                                send_for_s=min_time_s, min_requests=least))
    return summarize(results, duration, slos_ms, max(0, least - len(results)))


def _row(config: str, context: int, concurrency: int, s: dict, output_len: int, workload: str = "random",
         itl_slo_ms: float | None = None, stream_interval: int = DEFAULT_STREAM_INTERVAL) -> dict:
    def q(key, stat, scale):
        v = s[key].get(stat)
        return None if v is None else round(v * scale, 4)

    # requests still running when the point's time ran out (the budget was short, not a failure)
    cut = sum(e["count"] for e in s["errors"] if e["error"] == "cancelled at the time limit")
    g = s["goodput"]
    return {"config": config, "workload": workload, "context": context, "concurrency": concurrency,
            "output_len": output_len, "itl_slo_ms": itl_slo_ms, "stream_interval": stream_interval,
            "tokens_per_chunk": s.get("tokens_per_chunk"),
            "output_tok_s": s["output_token_throughput"], "bound_tok_s": None, "ttft_p50_s": q("ttft_ms", "p50", 1e-3),
            "ttft_p99_s": q("ttft_ms", "p99", 1e-3), "itl_p50_ms": q("itl_ms", "p50", 1),
            "itl_p99_ms": q("itl_ms", "p99", 1), "tpot_p50_ms": q("tpot_ms", "p50", 1),
            "slo": {f"{k}_ms": v for k, v in g["slos_ms"].items()}, "good_requests": g["good_requests"],
            "goodput_rps": g["goodput_rps"], "good_fraction": g["good_fraction"],
            "completed": s["successful"], "failed": s["failed"] - cut, "cancelled_at_limit": cut,
            "not_sent": s["not_sent"],
            "duration_s": s["duration_s"], "errors": s["errors"][:3]}


def hol_probe(base_url: str, tok, long_context: int, delay_s: float, seed: int = 7) -> dict:
    """TTFT of a short request alone, then of the same request sent ``delay_s`` after a long one."""
    import aiohttp

    from load_tests.client import RequestOptions, send_request
    from load_tests.datasets import random_dataset

    opts = RequestOptions(url=base_url + "/v1/completions", model=None, temperature=0.0, ignore_eos=True,
                          timeout_s=600)
    short = random_dataset(tok, 1, SHORT_LEN, HOL_OUTPUT, 0.0, seed)[0]
    long = random_dataset(tok, 1, long_context, HOL_OUTPUT, 0.0, seed + 1)[0]

    async def go():
        async with aiohttp.ClientSession() as session:
            t0 = time.perf_counter()
            solo = await send_request(session, opts, short, 0, t0)
            t0 = time.perf_counter()
            long_task = asyncio.create_task(send_request(session, opts, long, 1, t0))
            await asyncio.sleep(delay_s)
            during = await send_request(session, opts, short, 2, time.perf_counter())
            long_res = await long_task
            return solo, during, long_res

    solo, during, long_res = asyncio.run(go())
    return {"long_context": long_context, "short_len": SHORT_LEN, "delay_s": delay_s,
            "short_ttft_s": round(during.ttft, 4) if during.success else None,
            "short_solo_ttft_s": round(solo.ttft, 4) if solo.success else None,
            "long_ttft_s": round(long_res.ttft, 4) if long_res.success else None,
            "errors": [r.error for r in (solo, during, long_res) if not r.success]}


def prefix_probe(base_url: str, vocab: int, context: int, question_len: int = 64, seed: int = 11) -> dict:
    """Two questions on one document through HTTP: the second should reuse the document's pages.

    Token-id prompts (document + question), one generated token, non-streaming, so the latency
    is the time to the first token and ``usage.prompt_tokens_details.cached_tokens`` says how
    much of the prompt the prefix cache served.
    """
    import json
    import random

    rng = random.Random(seed + context)
    doc = [rng.randrange(vocab - 2) for _ in range(context)]

    def ask() -> tuple[float, int, int]:
        prompt = doc + [rng.randrange(vocab - 2) for _ in range(question_len)]
        body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", **auth_headers()})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            usage = json.load(r)["usage"]
        return time.perf_counter() - t0, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    first, n1, c1 = ask()
    cached, n2, c2 = ask()
    return {"context": context, "prompt_tokens": n2, "first_ttft_s": round(first, 4), "first_cached_tokens": c1,
            "cached_ttft_s": round(cached, 4), "cached_tokens": c2, "ratio": round(cached / first, 4)}


def engine_measurements(model: str, device: str, backend: str, ttft_contexts: list[int], ttft_configs: tuple[str, ...],
                        decode_points: dict[int, list[int]], decode_configs: tuple[str, ...],
                        decode_steps: int = 16) -> tuple[dict, dict]:
    """What the engine alone does, in this process before any server starts, on one copy of the
    weights: ``(engine_ttft_by_config, decode_step_ms)``.

    * ``{config: {context: s}}``: ``lserve bench e2e``'s TTFT at each of ``ttft_contexts``, per
      ``ttft_configs``, as that bench times it: one engine per configuration, the second of two
      prompts of each length (a fresh engine's first long prompt is slower; the served prompts
      come after warm-ups).
    * ``{config: {context: {C: ms}}}``: the pure decode step of ``C`` sequences at each context of
      ``decode_points`` (context -> concurrencies), per ``decode_configs``
      (:func:`lserve.bench.decode_step.decode_step_s`, the mean of ``decode_steps`` steps; one
      engine per configuration and context).

    On a CPU this runs on one torch thread: beside the servers and other processes, OpenMP
    threads spinning for the cores made steps 10-50x slower (a small model gains little from two).
    """
    import torch

    cuda = device.startswith("cuda")
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)
    try:
        return _engine_measurements(model, device, backend, ttft_contexts, ttft_configs, decode_points,
                                    decode_configs, decode_steps)
    finally:
        torch.set_num_threads(threads)


def _engine_measurements(model, device, backend, ttft_contexts, ttft_configs, decode_points, decode_configs,
                         decode_steps) -> tuple[dict, dict]:
    import torch

    from lserve.bench.decode_step import decode_engine, decode_step_s
    from lserve.bench.e2e import _engine, measure_engine
    from lserve.models.loader import load_model

    cuda = device.startswith("cuda")
    loaded = load_model(model, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    ttft: dict[str, dict[str, float]] = {}
    for config in ttft_configs if ttft_contexts else ():
        eng = _engine(loaded, model, engine_sparsity(config), max(ttft_contexts), device, backend, decode_steps=4)
        measure_engine(eng, min(2048, min(ttft_contexts)), 4)  # warm-up
        ttft[config] = {}
        for ctx in ttft_contexts:
            measure_engine(eng, ctx, 4, seed=ctx)
            t, _ = measure_engine(eng, ctx, 4, seed=ctx + 1)
            ttft[config][str(ctx)] = round(t, 4)
            _log(f"engine TTFT of {config} at {ctx}: {t:.3f} s")
        del eng
        gc.collect()
    steps: dict[str, dict[str, dict[str, float]]] = {}
    for config in decode_configs:
        for ctx, batches in sorted(decode_points.items()):
            eng = decode_engine(loaded, model, engine_sparsity(config), ctx, max(batches), device, backend,
                                steps=decode_steps)
            for c in sorted(batches):
                d = decode_step_s(eng, ctx, c, steps=decode_steps, seed=ctx)
                steps.setdefault(config, {}).setdefault(str(ctx), {})[str(c)] = round(d * 1e3, 3)
                _log(f"decode step of {config} at {ctx}, batch {c}: {d * 1e3:.2f} ms")
            del eng
            gc.collect()
    del loaded
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        _log(f"engine freed: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated in this process")
    return ttft, steps


def run_serve_bench(out_dir: str | Path = "benchmarks", name: str = "serve_h200", model: str = "llama3-8b",
                    device: str = "cuda", backend: str = "cupy", configs: tuple[str, ...] = ("lserve", "dense"),
                    contexts: tuple[int, ...] = (2048, 32768, 131072), short_concurrency=(1, 4, 16, 32),
                    long_concurrency=(1, 4), output_len: int = 64, point_time_s: float = 30.0,
                    extra_flags: tuple[str, ...] = (), port: int = 8321, hol: bool = True,
                    engine_contexts: tuple[int, ...] = (32768, 131072), deadline_s: float | None = None,
                    prefix_contexts: tuple[int, ...] = (), prefix_name: str = "prefix_cache_h200",
                    workload: str = "random", plan: tuple[str, ...] = (), requests_per_c: int = 8,
                    point_limit_s: float = 600.0, slo_ttft_ms: float = 30000.0, slo_itl_ms: float = 200.0,
                    itl_slo_sweep: tuple[float, ...] = (), sweep_point: str | None = None,
                    decode_step_min_c: int | None = 1, sweep_configs: tuple[str, ...] | None = None,
                    stream_intervals: tuple[int, ...] = ()) -> dict:
    """Run the served benchmark and write ``<out_dir>/<name>.json`` + ``.png``; returns the report.

    Load points come from ``plan`` (``WORKLOAD:CONTEXT:C1,C2[:OUTPUT]``, :func:`parse_plan`), else
    from ``contexts`` x (``short_concurrency`` up to 4k, else ``long_concurrency``) with
    ``workload``. ``itl_slo_sweep``: serve ``sweep_point`` (``CONTEXT:C``, the same workload as
    the plan's entry at that context, or the longest context at concurrency 4) once per
    ``--itl-slo-ms`` value, per configuration of ``sweep_configs`` (default ``configs``), after the
    plan (a plan entry at the sweep point is its point at the servers' default SLO, so that value
    need not be swept again: every server start costs ~45 s on the H200). ``decode_step_min_c``: time the
    pure decode step (``decode_step_ms``, the bound's ``d``) of every point with at least that
    concurrency, per configuration, before the servers start (None: none, and no bound).
    ``stream_intervals``: serve each configuration's plan once per ``--stream-interval`` value
    (server logs and start-up times tagged ``<config>@si<N>``, rows with their ``stream_interval``;
    the probes run with the first); empty: once, at the interval of ``extra_flags`` or the default.
    """
    t_start = time.monotonic()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    default_out = WORKLOADS[workload] or output_len
    if plan:
        points = parse_plan(list(plan), default_out)
    else:
        points = [(workload, ctx, list(short_concurrency if ctx <= 4096 else long_concurrency), default_out)
                  for ctx in contexts]
    sweep = None
    if itl_slo_sweep:
        sctx, sc = (int(x) for x in (sweep_point or f"{max(p[1] for p in points)}:4").split(":"))
        wl, out = next(((w, o) for w, c, _, o in points if c == sctx), (workload, default_out))
        sweep = (wl, sctx, [sc], out)
    everything = points + ([sweep] if sweep else [])
    contexts = tuple(sorted({p[1] for p in everything}))
    size = server_size(everything, prefix_contexts, hol)
    common = ["--model", model, "--device", device, "--backend", backend, "--max-model-len",
              str(size.max_model_len), "--max-cache-tokens", str(size.cache_tokens), "--max-num-seqs",
              str(size.max_num_seqs), "--max-ongoing-requests", str(2 * size.max_num_seqs), *extra_flags]
    slos = {"ttft": slo_ttft_ms, "itl": slo_itl_ms}
    report = {**header(), "model": model, "backend": backend, "output_len": default_out, "server_flags": common,
              "config_flags": CONFIG_FLAGS, "point_time_s": point_time_s, "requests_per_c": requests_per_c,
              "slo_ms": slos, "rows": [], "engine_ttft_s": {}, "hol": None, "hol_repeat": None, "steps": {}, "startup_s": {},
              "itl_sweep": []}

    def save():
        bound_tok_s(report["rows"] + report["itl_sweep"], report.get("engine_ttft_by_config"),
                    report.get("decode_step_ms"))
        write_json(path, report)
        plot_serve(report, path.with_suffix(".png"))
        if report["itl_sweep"]:
            plot_itl_sweep(report, out_dir / f"{name}_itl_slo.png")

    def time_left() -> float:
        return float("inf") if deadline_s is None else deadline_s - (time.monotonic() - t_start)

    decode_points: dict[int, set[int]] = {}
    for _, ctx, concs, _ in everything:
        decode_points.setdefault(ctx, set()).update(c for c in concs if decode_step_min_c and c >= decode_step_min_c)
    decode_points = {ctx: sorted(cs) for ctx, cs in decode_points.items() if cs}
    if engine_contexts or decode_points:
        t0 = time.monotonic()
        by_config, steps = engine_measurements(model, device, backend, list(engine_contexts),
                                               tuple(c for c in configs if c != "dense") or configs,
                                               decode_points, configs)
        report["engine_s"] = round(time.monotonic() - t0, 1)
        if by_config:
            report["engine_ttft_by_config"] = by_config
            report["engine_ttft_s"] = by_config.get("lserve", next(iter(by_config.values())))
        report["decode_step_ms"] = steps
        save()
    tok = _tokenizer(_vocab(model))

    def serve(config: str, flags: list[str], tag: str, pts, rows: list, probes: bool) -> None:
        srv = Server(common + CONFIG_FLAGS[config] + flags, port, out_dir / f"{name}_{tag}_server.log")
        slo_flag = served_itl_slo_ms(common + CONFIG_FLAGS[config] + flags)
        interval = served_stream_interval(common + CONFIG_FLAGS[config] + flags)
        try:
            report["startup_s"][tag] = round(srv.wait_healthy(300), 1)
            _log(f"{tag}: healthy after {report['startup_s'][tag]} s")
            for ctx in sorted({min(c, 32768) for c in contexts}):  # warm-up: kernels, graphs, allocator
                w = run_point(srv.base_url, tok, ctx, 1, 8, 90, min_time_s=0.0, requests_per_c=1)
                _log(f"{tag}: warm-up at {ctx}: {w['successful']} ok, TTFT {w['ttft_ms']['p50']} ms, "
                     f"errors {w['errors']}")
                if not w["successful"]:
                    dump_stacks(out_dir / f"{name}_{tag}_stacks.txt")
                    raise RuntimeError(f"{tag}: the warm-up request did not complete; stacks dumped")
            if probes and prefix_contexts and config == "lserve":
                prefix_probe(srv.base_url, _vocab(model), 8192, seed=99)  # warm-up: the cached-prefix path once
                report["prefix_cache"] = [prefix_probe(srv.base_url, _vocab(model), ctx) for ctx in prefix_contexts]
                _log(f"prefix cache: {report['prefix_cache']}")
                write_json(out_dir / f"{prefix_name}.json", {**header(), "model": model, "backend": backend,
                                                             "config_flags": CONFIG_FLAGS["lserve"],
                                                             "server_flags": common, "rows": report["prefix_cache"]})
                save()
            if probes and size.hol_context and config == "lserve":
                # twice on one server: a first-use cost shows as the first probe's excess alone; the
                # replica's steps of each (kinds, counts, ms) say where it goes
                for key, seed in (("hol", 7), ("hol_repeat", 17)):
                    steps0 = srv.engine_steps()
                    report[key] = hol_probe(srv.base_url, tok, size.hol_context, delay_s=1.0, seed=seed)
                    report[key]["step_time"] = step_time(steps0, srv.engine_steps())
                    _log(f"{key}: {report[key]}; steps {step_line(report[key]['step_time'])}")
                save()
            for wl, ctx, concs, out in pts:
                for c in concs:
                    limit = min(point_limit_s, time_left() - 30)
                    if limit < 5:
                        _log(f"skipping {tag} {wl} ctx {ctx} C={c}: out of time")
                        continue
                    m0, steps0 = srv.scrape(), srv.engine_steps()
                    s = run_point(srv.base_url, tok, ctx, c, out, limit, seed=ctx + c, workload=wl,
                                  min_time_s=point_time_s, requests_per_c=requests_per_c, slos_ms=slos)
                    m1 = srv.scrape()
                    row = {**_row(config, ctx, c, s, out, wl, slo_flag, interval),
                           "replica": replica_means(*(histogram_totals(m, REPLICA_SIDE.values()) if m else {}
                                                      for m in (m0, m1))),
                           "step_time": step_time(steps0, srv.engine_steps())}
                    if slo_flag:  # is an ITL tail past the SLO the engine's steps, or Ray and HTTP?
                        row["replica"]["itl_above_slo"] = share_above(m0, m1, REPLICA_ITL, slo_flag / 1e3)
                    rows.append(row)
                    _log(f"{tag} {wl} ctx {ctx} C={c} out {out}: {row['completed']} ok / {row['failed']} failed, "
                         f"{row['output_tok_s']} tok/s, TTFT p50 {row['ttft_p50_s']} s, ITL (per chunk of "
                         f"{row['tokens_per_chunk']} tokens) p50/p99 "
                         f"{row['itl_p50_ms']}/{row['itl_p99_ms']} ms, good {row['good_requests']}; "
                         f"replica {row['replica']}; steps {step_line(row['step_time'])}")
                    save()
            report["steps"][tag] = srv.get_json("/admin/engines")
        finally:
            srv.stop()
        save()

    for config in configs:
        for i, si in enumerate(stream_intervals or (None,)):
            tag = config if si is None else f"{config}@si{si}"
            if time_left() < 60:
                _log(f"skipping {tag}: out of time")
                continue
            serve(config, [] if si is None else ["--stream-interval", str(si)], tag, points, report["rows"],
                  probes=i == 0)
    for ms in itl_slo_sweep:
        for config in sweep_configs or configs:
            if time_left() < 60:
                _log(f"skipping the ITL SLO sweep of {config} at {ms} ms: out of time")
                continue
            serve(config, ["--itl-slo-ms", str(ms)], f"{config}@itl{ms:g}", [sweep], report["itl_sweep"], probes=False)
    report["wall_s"] = round(time.monotonic() - t_start, 1)
    save()
    _log(summary(report))
    return report


def merge_reports(paths: list[str | Path], out_dir: str | Path, name: str) -> dict:
    """One report from runs that measured different points (e.g. one device call per context
    range, both configurations in each): rows, engine TTFTs, steps and start-up times joined,
    the first run's header kept and every run's header listed under ``runs``."""
    import json

    parts = [json.loads(Path(p).read_text()) for p in paths]
    report = dict(parts[0])
    report["runs"] = [{k: r.get(k) for k in ("command", "date", "device", "wall_s", "output_len")} for r in parts]
    report["rows"] = [row for r in parts for row in r["rows"]]
    report["itl_sweep"] = [row for r in parts for row in r.get("itl_sweep") or []]
    for key in ("engine_ttft_s", "steps", "startup_s"):
        report[key] = {f"{k}" if key == "engine_ttft_s" else f"{k}@{i}": v for i, r in enumerate(parts)
                       for k, v in (r.get(key) or {}).items()}
    report["engine_ttft_by_config"], report["decode_step_ms"] = {}, {}
    for r in parts:
        for config, ttfts in (r.get("engine_ttft_by_config") or {}).items():
            report["engine_ttft_by_config"].setdefault(config, {}).update(ttfts)
        for config, by_ctx in (r.get("decode_step_ms") or {}).items():
            for ctx, by_c in by_ctx.items():
                report["decode_step_ms"].setdefault(config, {}).setdefault(ctx, {}).update(by_c)
    report["hol"] = next((r["hol"] for r in parts if r.get("hol")), None)
    report["hol_repeat"] = next((r["hol_repeat"] for r in parts if r.get("hol_repeat")), None)
    path = Path(out_dir) / f"{name}.json"
    bound_tok_s(report["rows"] + report["itl_sweep"], report["engine_ttft_by_config"], report["decode_step_ms"])
    write_json(path, report)
    plot_serve(report, path.with_suffix(".png"))
    if report["itl_sweep"]:
        plot_itl_sweep(report, Path(out_dir) / f"{name}_itl_slo.png")
    _log(summary(report))
    return report


def _vocab(model: str) -> int:
    from lserve.models import presets

    return presets.preset_config(model).vocab_size


def summary(report: dict) -> str:
    """A short text table of the rows (and of the ITL SLO sweep)."""
    def line(r: dict) -> str:
        si = r.get("stream_interval", 1)
        config = r["config"] if si == 1 else f"{r['config']}@si{si}"
        return (f"{config:13s} {r.get('workload', 'random'):9s} {r['context']:7d} {r['output_len']:5d} "
                f"{r['concurrency']:3d} {r['output_tok_s']:8.1f} {r.get('bound_tok_s')!s:>8s} {r.get('decode_step_ms')!s:>7s}  "
                f"{r['ttft_p50_s']}/{r['ttft_p99_s']}  {r['itl_p50_ms']}/{r['itl_p99_ms']}  "
                f"{r['completed']}/{r['failed']}  {r.get('good_requests')}  {r.get('itl_slo_ms')}")
    head = ("config        workload  context   out   C    tok/s    bound  step ms  TTFT p50/p99 s  ITL p50/p99 ms  "
            "ok/failed  good  itl-slo")
    lines = [head, *(line(r) for r in report["rows"])]
    if report.get("itl_sweep"):
        lines += ["ITL SLO sweep:", head, *(line(r) for r in report["itl_sweep"])]
    lines.append(f"SLOs for goodput: {report.get('slo_ms')}")
    lines.append(f"engine TTFT: {report.get('engine_ttft_by_config') or report['engine_ttft_s']}  hol: {report['hol']}")
    return "\n".join(lines)
