"""``lserve bench e2e``: TTFT and per-token decode latency of the whole engine vs context length.

For each configuration (dense, static only, dynamic only, LServe) and prompt length: one request,
TTFT = time from submission to the first sampled token (whole prompt in one prefill step), then
the median wall time per token of >= ``decode_steps`` decode steps at that context (CUDA graphs
and async decode, as the engine runs by default: a ``step()`` launches the next decode step
before it reads its own step's tokens, so the time between its returns is the per-token interval
with the host work hidden behind the GPU; ``replay_gpu_ms`` is the GPU time of one graph
replay). The Hugging Face ``transformers`` peer runs the same random weights with SDPA. Also a
batched decode point, the weight-read floor, and the largest total context whose KV fits in the
memory left after the weights (minus a reserve for activations), per configuration and KV
storage (bf16, INT8, INT4), the target pair allocated for real.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from lserve.bench.report import header, write_json
from lserve.config import CacheConfig, ConfigError, EngineConfig, SparsityConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams
from lserve.models.loader import LoadedModel, load_model
from lserve.plotting import pyplot

CONFIGS = {
    "dense": SparsityConfig(token_budget=0),
    "static": SparsityConfig(pattern="random", static_sparsity=0.5, token_budget=0),
    "dynamic": SparsityConfig(token_budget=4096, reuse_interval=4),
    "lserve": SparsityConfig(pattern="random", static_sparsity=0.5, token_budget=4096, reuse_interval=4),
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Measured device copy bandwidth in bytes/s (read + write counted)."""
    x = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    _sync(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        y.copy_(x)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def _engine(loaded: LoadedModel, model: str, sp: SparsityConfig, context: int, device: str, backend: str,
            decode_steps: int, kv_quant: str = "none", num_seqs: int = 1, async_decode: bool = True) -> LLMEngine:
    cache = CacheConfig(dense_pool_tokens=num_seqs * (context + decode_steps + 64), kv_quant=kv_quant)
    cfg = EngineConfig(model=model, sparsity=sp, cache=cache, device=device, backend=backend, max_num_seqs=num_seqs,
                       max_batched_tokens=max(context, 16), max_model_len=context + decode_steps + 64,
                       async_decode=async_decode)
    return LLMEngine(cfg, loaded)


def measure_engine(engine: LLMEngine, context: int, decode_steps: int, seed: int = 0,
                   token_budget: int | None = None, prefill_sparsity: float | None = None) -> tuple[float, float]:
    """(TTFT seconds, median decode seconds per token) for one random prompt of ``context`` tokens
    (``token_budget``, ``prefill_sparsity``: per-request overrides, None for the engine's).

    Each decode ``step()`` returns one token; its wall time is the interval between tokens (with
    async decode it has launched the next step before waiting for this one's token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, engine.model_config.vocab_size - 2, (context,), generator=g).tolist()
    dev = engine.config.device
    engine.add_request(ids, SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True,
                                           token_budget=token_budget, prefill_sparsity=prefill_sparsity))
    _sync(dev)
    t0 = time.perf_counter()
    while not any(o.token_ids for o in engine.step()):
        pass
    ttft = time.perf_counter() - t0
    steps = []
    while engine.has_unfinished():
        t1 = time.perf_counter()
        engine.step()  # returns when this step's token is on the host (the next may be running)
        steps.append(time.perf_counter() - t1)
    return ttft, statistics.median(steps)


@torch.inference_mode()
def measure_hf(loaded: LoadedModel, context: int, decode_steps: int, device: str, dtype) -> tuple[float, float]:
    """transformers' own model of the family (SDPA, its dynamic cache) on the same weights: (TTFT s,
    median s per token).

    The prefill and each decode step are one ``forward`` each, as ``generate`` does them, timed
    until the greedy token is on the host.
    """
    from transformers import AutoModelForCausalLM

    from lserve.models.hf_config import hf_config

    c = loaded.config
    cfg = hf_config(c, max_position_embeddings=max(c.max_position_embeddings, context + decode_steps + 8),
                    attn_implementation="sdpa")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.load_state_dict(loaded.weights, strict=True)
    model.eval()
    x = torch.randint(0, c.vocab_size - 2, (1, context), device=device)
    model(x[:, :64], use_cache=True, logits_to_keep=1)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    out = model(x, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    tok.item()
    ttft = time.perf_counter() - t0
    pkv, steps = out.past_key_values, []
    for _ in range(decode_steps):
        t1 = time.perf_counter()
        out = model(tok, past_key_values=pkv, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        tok.item()  # the token is on the host: the step is complete
        steps.append(time.perf_counter() - t1)
        pkv = out.past_key_values
    per_tok = statistics.median(steps)
    del model
    return ttft, per_tok


def measure_batch(engine: LLMEngine, batch: int, context: int, decode_steps: int, seed: int = 0) -> tuple[float, float]:
    """(seconds until every request has its first token, median seconds per decode step) for
    ``batch`` random prompts of ``context`` tokens decoding together."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(batch):
        ids = torch.randint(0, engine.model_config.vocab_size - 2, (context,), generator=g).tolist()
        engine.add_request(ids, SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True))
    _sync(engine.config.device)
    t0 = time.perf_counter()
    started = 0
    while started < batch:
        started += sum(1 for o in engine.step() if len(o.token_ids) == 1)
    ttft = time.perf_counter() - t0
    steps = []
    while engine.has_unfinished():
        t1 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t1)
    return ttft, statistics.median(steps)


def _cache(loaded: LoadedModel, model: str, sp: SparsityConfig, device: str, kv_quant: str, tokens: int):
    """The KV cache an engine of this configuration would allocate for ``tokens`` tokens (no
    engine: an engine holds its own permuted copy of the weights)."""
    from lserve.engine.llm_engine import build_cache, build_layout

    mc = loaded.config
    cfg = EngineConfig(model=model, sparsity=sp, cache=CacheConfig(dense_pool_tokens=tokens, kv_quant=kv_quant),
                       device=device, max_num_seqs=1)
    return build_cache(cfg, mc, build_layout(cfg, mc), cfg.torch_dtype())


def kv_bytes_per_token(loaded: LoadedModel, model: str, sp: SparsityConfig, device: str, kv_quant: str) -> float:
    """Dense-pool bytes per cached token (K, V, quantization scales, key statistics); the
    streaming heads' rings are O(1) per sequence and not counted."""
    c = _cache(loaded, model, sp, device, kv_quant, 4096)
    return c.nbytes()["dense"] / (c.dense_alloc.num_pages * c.page_size)


def max_context(loaded: LoadedModel, model: str, device: str, free_bytes: int,
                verify: tuple[str, ...] = ("dense", "lserve+int4")) -> tuple[dict[str, int], dict[str, float]]:
    """Largest total context (tokens, all sequences together) whose KV fits in ``free_bytes``
    (the memory left beside one copy of the weights, minus a reserve for activations), per
    configuration and KV storage; the ``verify`` ones are allocated for real."""
    tokens, per_token = {}, {}
    for cname, sp in CONFIGS.items():
        for q in ("none", "int8", "int4"):
            label = cname + ("" if q == "none" else f"+{q}")
            per_token[label] = kv_bytes_per_token(loaded, model, sp, device, q)
            tokens[label] = int(free_bytes // per_token[label]) // 64 * 64
    for label in verify:
        cname, _, q = label.partition("+")
        c = _cache(loaded, model, CONFIGS[cname], device, q or "none", tokens[label])
        assert c.dense_alloc.num_pages * c.page_size >= tokens[label]
        del c
        gc.collect()
        torch.cuda.empty_cache()
    return tokens, per_token


ADAPTIVE = "lserve-adaptive"


def adaptive_configs(spec: str | None, loaded: LoadedModel, model: str, out: Path,
                     name: str) -> tuple[dict[str, SparsityConfig], dict | None]:
    """LServe with per-layer decode budgets around the same mean (``lserve-adaptive``), and what
    the report says of the ratios; nothing when ``spec`` is None.

    ``spec``: ``"auto"`` (the model's shipped calibration), a calibration path, or
    ``"resampled"``: the default model's calibration resampled to this model's layers, weighted
    by the dense heads of the ``lserve`` configuration's layout
    (:func:`~lserve.sparsity.adaptive_budget.resample_calibration`), written beside the report
    as ``{name}_adaptive_budgets.json`` and run from there. A spec that cannot apply to the
    model is refused here, before any run.
    """
    from lserve.engine.llm_engine import build_layout
    from lserve.sparsity.adaptive_budget import resample_calibration, resolve_ratios

    if spec is None:
        return {}, None
    base = CONFIGS["lserve"]
    info: dict = {"spec": spec, "mean_budget": base.token_budget}
    if spec == "resampled":
        dense = build_layout(EngineConfig(model=model, sparsity=base), loaded.config).n_dense()
        record = resample_calibration(dense)
        path = out / f"{name}_adaptive_budgets.json"
        write_json(path, record)
        spec = str(path)
        info.update(file=path.name, **{k: record[k] for k in ("resampled", "resampled_from", "source_layers", "rule")})
    ratios = resolve_ratios(spec, loaded.config)
    if ratios is None:
        raise ConfigError("--adaptive-budgets: give 'auto', 'resampled' or a calibration file, not an empty value")
    info["ratios"] = list(ratios)
    return {ADAPTIVE: replace(base, adaptive_budgets=spec)}, info


def layer_budgets(eng: LLMEngine) -> dict:
    """Tokens each layer's dense heads keep at the engine's mean budget, and their dense-head-weighted
    mean (what the engine runs, after rounding to whole pages)."""
    page, n_dense = eng.cache.page_size, eng.layout.n_dense()
    mean_pages = eng.config.sparsity.token_budget // page
    tokens = [eng.backend.layer_budget_pages(layer, mean_pages) * page if n else None
              for layer, n in enumerate(n_dense)]
    weighted = sum(n * t for n, t in zip(n_dense, tokens) if t is not None) / max(1, sum(n_dense))
    return {"layer_tokens": tokens, "dense_heads": n_dense, "weighted_mean_tokens": round(weighted, 1)}


def prefill_sparse_configs(taus) -> dict[str, SparsityConfig]:
    """LServe plus block-sparse prefill of the dense heads at each tau (``lserve-prefill-sparse@TAU``)."""
    return {f"lserve-prefill-sparse@{t:g}": replace(CONFIGS["lserve"], prefill_sparsity=t) for t in taus}


def _jobs(contexts, hf: bool, hf_max_context: int, side_max_context: int | None, batched,
          extra: tuple[str, ...] = ()) -> list[tuple]:
    """Runs in the order that answers the targets first (a deadline may cut the tail):
    dense and LServe (and the ``extra`` configurations) at the shortest and longest contexts,
    transformers at 128k, the rest."""
    cs = sorted(contexts)
    main_order = [cs[0]] + sorted(cs[1:], reverse=True)
    jobs = [(c, ctx) for ctx in main_order for c in ("dense", "lserve", *extra)]
    hf_ctx = sorted((c for c in cs if c <= hf_max_context), key=lambda c: (c != 131072, -c)) if hf else []
    jobs += [("transformers", ctx) for ctx in hf_ctx[:1]] + [("max-context", None)]
    jobs += [("transformers", ctx) for ctx in hf_ctx[1:]]
    side = [c for c in cs if side_max_context is None or c <= side_max_context]
    jobs += [(c, ctx) for ctx in side for c in ("static", "dynamic")]
    if batched:
        jobs += [("batched", "dense"), ("batched", "lserve")]
    return jobs


def run_e2e_bench(out_dir: str | Path = "benchmarks", model: str = "llama3-8b", device: str = "cuda",
                  backend: str = "cupy", contexts=(8192, 32768, 65536, 131072, 262144), decode_steps: int = 64,
                  hf: bool = True, hf_max_context: int = 131072, name: str = "e2e_h200",
                  batched: tuple[int, int] | None = (8, 32768), reserve_gib: float = 8.0,
                  side_max_context: int | None = None, deadline_s: float | None = None,
                  async_decode: bool = True, prefill_sparsity=(), adaptive_budgets: str | None = None) -> dict:
    """Measure the configurations; write ``{name}.json`` (after every run) and ``{name}.png``.

    ``side_max_context`` caps the contexts of the static-only and dynamic-only configurations;
    ``deadline_s`` skips the runs that would start after that many seconds (listed in the report);
    ``async_decode`` False measures the engine with host and GPU work one after the other;
    ``prefill_sparsity``: taus of extra ``lserve-prefill-sparse@TAU`` configurations (their rows
    carry the kept fraction of the dense heads' causal prefill tiles); ``adaptive_budgets``: also
    ``lserve-adaptive``, LServe with per-layer budgets of the same mean (:func:`adaptive_configs`;
    the report's ``adaptive_budgets`` holds the ratios, where they came from and the tokens each
    layer keeps).

    Single-sequence rows time two prompts of the context's length (different tokens, no prefix
    hit): ``ttft_s`` is the second's, as a served process that has seen such a prompt runs it,
    ``ttft_first_s`` the first's. On the H200 the first long prompt of a fresh engine is much
    slower with the host waiting on the GPU (128k dense 17.1 s, then 11.3 s;
    ``scripts/probes/probe_first_prefill.py``), and cuDNN builds plans for a sparse prefill's gathered
    row shapes.
    """
    from lserve.sparsity.threshold import lookup_ratio, profile_key

    t_start = time.perf_counter()
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    loaded = load_model(model, dtype=dtype, device=device)
    gpu = device.startswith("cuda")
    free_after_weights = torch.cuda.mem_get_info()[0] - int(reserve_gib * 2 ** 30) if gpu else 0
    found = lookup_ratio(profile_key(device, loaded.config, dtype))
    bw = copy_bandwidth(device) if gpu else None
    weight_bytes = sum(t.numel() * t.element_size() for t in loaded.weights.values())
    report = {**header(), "model": model, "backend": backend, "decode_steps": decode_steps,
              "weight_bytes": weight_bytes, "copy_bandwidth_TBps": bw and round(bw / 1e12, 3),
              "weight_floor_ms": bw and round(weight_bytes / bw * 1e3, 3), "rows": [],
              "max_context_tokens": {}, "kv_bytes_per_token": {}, "kv_budget_bytes": free_after_weights,
              "dynamic_threshold_ratio": found and found[0], "async_decode": async_decode, "cuda_graphs": {},
              "skipped": []}
    out = Path(out_dir)
    rows = report["rows"]

    def release():
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()

    def row(config, batch, ctx, ttft, per_token, **extra):
        rows.append({"model": model, "config": config, "batch": batch, "context": ctx,
                     "ttft_s": None if ttft is None else round(ttft, 4),
                     "decode_ms_per_token": None if per_token is None else round(per_token * 1e3, 3), **extra})

    adaptive, report["adaptive_budgets"] = adaptive_configs(adaptive_budgets, loaded, model, out, name)
    configs = {**CONFIGS, **adaptive, **prefill_sparse_configs(prefill_sparsity)}
    jobs = _jobs(contexts, hf, hf_max_context, side_max_context, batched,
                 tuple(c for c in configs if c not in CONFIGS))
    for cname, ctx in tqdm(jobs, desc="e2e", unit="run"):
        if cname == "max-context" and not gpu:
            continue
        if deadline_s is not None and time.perf_counter() - t_start > deadline_s:
            report["skipped"].append(f"{cname}@{ctx}")
            continue
        try:
            if cname == "transformers":
                ttft, dec = measure_hf(loaded, ctx, decode_steps, device, dtype)
                row(cname, 1, ctx, ttft, dec)
            elif cname == "max-context":
                mx, per = max_context(loaded, model, device, free_after_weights)
                report["max_context_tokens"] = mx
                report["kv_bytes_per_token"] = {k: round(v, 1) for k, v in per.items()}
            else:
                config, nb, c = (ctx, batched[0], batched[1]) if cname == "batched" else (cname, 1, ctx)
                eng = _engine(loaded, model, configs[config], c, device, backend, decode_steps, num_seqs=nb,
                              async_decode=async_decode)
                measure_engine(eng, 256, 4)  # warm-up: kernels compiled, allocator primed
                if config == ADAPTIVE and "layer_tokens" not in report["adaptive_budgets"]:
                    report["adaptive_budgets"].update(layer_budgets(eng))
                if eng.graphs is not None:
                    eng.graphs.events = []  # GPU time of each replay (without async decode the rest is host work)
                if nb == 1:
                    tiles0 = list(eng.backend.prefill_tiles)
                    first, _ = measure_engine(eng, c, decode_steps)
                    kept = eng.backend.prefill_kept_since(tiles0)
                    extra = {"ttft_first_s": round(first, 4)}
                    if kept is not None:
                        extra["prefill_kept_fraction"] = kept
                    read0 = replace(eng.backend.kv_read.total)
                    ttft, dec = measure_engine(eng, c, decode_steps, seed=1)  # another prompt: no prefix hit
                    read = eng.backend.kv_read.total
                    if read.dense > read0.dense:  # share of dense attention's KV bytes its decode steps read
                        extra["kv_read_fraction"] = round((read.read - read0.read) / (read.dense - read0.dense), 4)
                    row(config, 1, c, ttft, dec, **extra)
                else:
                    ttft, step = measure_batch(eng, nb, c, decode_steps)
                    row(config, nb, c, ttft, step, decode_tok_s=round(nb / step, 1))
                if eng.graphs is not None:
                    gms = eng.graphs.replay_ms()
                    rows[-1]["replay_gpu_ms"] = round(statistics.median(gms), 3) if gms else None
                    report["cuda_graphs"][f"{config}x{nb}@{c}"] = {
                        "captures": eng.graphs.captures, "replays": eng.graphs.replays, "disabled": eng.graphs.disabled,
                        "fused_ops": eng.model.fused is not None, "fused_problem": eng.fused_problem}
                del eng
        except torch.OutOfMemoryError:
            if cname in configs or cname == "transformers":
                row(cname, 1, ctx, None, None, error="out of memory")
        release()
        write_json(out / f"{name}.json", report)
    if adaptive:
        report["adaptive_budgets"]["decode_adaptive_over_uniform"] = adaptive_over_uniform(report)
    write_json(out / f"{name}.json", report)  # with the skipped runs
    plot_e2e(report, out / f"{name}.png")
    print(summary(report))
    return report


def adaptive_over_uniform(report: dict) -> dict[int, float | None]:
    """Context -> decode ms per token of ``lserve-adaptive`` over ``lserve`` (batch 1; None where
    either is missing)."""
    by = {(r["config"], r["context"]): r.get("decode_ms_per_token") for r in report["rows"] if r["batch"] == 1}
    out = {}
    for (c, ctx), ms in sorted(by.items(), key=lambda kv: kv[0][1]):
        if c == ADAPTIVE:
            uniform = by.get(("lserve", ctx))
            out[ctx] = round(ms / uniform, 3) if ms and uniform else None
    return out


def summary(report: dict) -> str:
    """The decode / TTFT table and the targets, as text."""
    by = {(r["config"], r["batch"], r["context"]): r for r in report["rows"]}
    lines = [f"weight floor {report['weight_floor_ms']} ms (copy {report['copy_bandwidth_TBps']} TB/s), "
             f"async decode {'on' if report.get('async_decode', True) else 'off'}",
             f"{'config':>25} {'batch':>5} {'context':>8} {'TTFT s':>9} {'ms/token':>9} {'graph GPU ms':>12}"]
    for r in report["rows"]:
        lines.append(f"{r['config']:>25} {r['batch']:>5} {r['context']:>8} {r['ttft_s']!s:>9} "
                     f"{r['decode_ms_per_token']!s:>9} {r.get('replay_gpu_ms')!s:>12}")
    if report.get("skipped"):
        lines.append(f"skipped (deadline): {', '.join(report['skipped'])}")

    def ratio(a, b, key):
        x, y = by.get(a), by.get(b)
        if not x or not y or not x.get(key) or not y.get(key):
            return None
        return round(y[key] / x[key], 3)

    mx = report.get("max_context_tokens", {})
    top = by.get(("lserve", 1, 262144))
    floor = report.get("weight_floor_ms")
    over_floor = round(top["decode_ms_per_token"] / floor, 3) if top and floor and top["decode_ms_per_token"] else None
    lines += [
        f"decode 256k dense/lserve: {ratio(('lserve', 1, 262144), ('dense', 1, 262144), 'decode_ms_per_token')}"
        " (target >= 2.5)",
        f"decode 256k lserve/floor: {over_floor} (target <= 1.25)",
        f"TTFT 128k transformers/lserve: {ratio(('lserve', 1, 131072), ('transformers', 1, 131072), 'ttft_s')}"
        " (target >= 1.8)",
        f"decode 8k dense/lserve: {ratio(('lserve', 1, 8192), ('dense', 1, 8192), 'decode_ms_per_token')}"
        " (target >= 1)",
        f"max context lserve+int4 / dense: {round(mx['lserve+int4'] / mx['dense'], 2) if mx.get('dense') else None}"
        " (target >= 4)",
    ]
    for ctx, x in adaptive_over_uniform(report).items():
        lines.append(f"decode {ctx} {ADAPTIVE}/lserve ms per token: {x} (target <= 1.05)")
    for c in sorted({r["config"] for r in report["rows"]} - set(CONFIGS) - {"transformers", ADAPTIVE}):
        kept = {r["context"]: r.get("prefill_kept_fraction") for r in report["rows"] if r["config"] == c}
        lines.append(f"{c}: TTFT 128k transformers/it {ratio((c, 1, 131072), ('transformers', 1, 131072), 'ttft_s')} "
                     f"(target >= 2.5), TTFT 256k dense/it {ratio((c, 1, 262144), ('dense', 1, 262144), 'ttft_s')} "
                     f"(target >= 3), kept fraction {kept}")
    return "\n".join(lines)


def plot_e2e(report: dict, path: Path) -> None:
    """Decode latency per token vs context, one line per configuration, with the weight floor."""
    plt = pyplot()
    if plt is None:
        return

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for cname in sorted({r["config"] for r in report["rows"]}):
        pts = sorted((r["context"], r["decode_ms_per_token"], r["ttft_s"]) for r in report["rows"]
                     if r["config"] == cname and r["batch"] == 1 and r["decode_ms_per_token"] is not None)
        a1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=cname)
        a2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=cname)
    if report.get("weight_floor_ms"):
        a1.axhline(report["weight_floor_ms"], color="k", ls=":", label="weight-read floor")
    for ax, title, unit in ((a1, "decode latency per token", "ms"), (a2, "time to first token", "s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel(unit)
        ax.set_title(f"{title}, {report['model']}, {report['device']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
