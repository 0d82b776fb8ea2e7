"""Host KV tier on the cupy backend (issue 39): decode ms/token vs context with the tier and all-GPU.

``python -m lserve.bench.host_tier OUT [--contexts 131072,524288,1048576] [--resident-tokens 65536]
[--deadline 500]``: llama3-8b preset (random weights), LServe sparsity, INT4 KV. Per context, one
request of that many tokens with the dense pool cut to ``--resident-tokens`` and the rest in the
host tier, and the all-GPU engine where its pool fits beside the weights. Rows carry decode
ms/token, TTFT, H2D bytes per decode step and the hit rate; the report also holds the longest
context one request can hold with the tier (its virtual pages) against all-GPU. Writes
``OUT/host_tier_h200.json`` after every run and ``OUT/host_tier_h200.png``. Runs go shortest
context first (tier, then all-GPU), so a cut loses the longest; a run whose estimated time
(:func:`estimate_s`, scaled from the longest context measured so far) would pass the deadline is
listed as skipped, and one that passes it while prefilling is aborted and kept as a ``cut`` row
(tokens prefilled, seconds). Progress lines (one per prefill chunk) go to stdout.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import psutil
import torch

from lserve.bench.report import header, write_json
from lserve.config import CacheConfig, EngineConfig

CONTEXTS = (131072, 524288, 1048576)
DECODE_STEPS = 32


def plan_runs(contexts, gpu_bytes: float, bytes_per_token: float, host_bytes: float, resident_tokens: int,
              margin: float = 1.1) -> list[dict]:
    """The runs to make: per context a tier run (where the host holds it) and an all-GPU run (where
    its pool fits ``gpu_bytes``), each with the host GiB it needs (0 all-GPU)."""
    runs = []
    for ctx in sorted(contexts):  # shortest first: a deadline cuts the longest
        need = (ctx + DECODE_STEPS + 1024) * bytes_per_token * margin
        if need <= host_bytes:
            runs.append({"mode": "tier", "context": ctx, "host_kv_gib": round(need / 2**30, 2),
                         "resident_tokens": resident_tokens})
        if need <= gpu_bytes:
            runs.append({"mode": "gpu", "context": ctx, "host_kv_gib": 0.0, "resident_tokens": 0})
    return runs


# Before any run is measured: a 128k prefill's seconds (the all-GPU TTFT on the H200 was 9.4 s;
# with margin) and an engine's set-up.
PRIOR_TTFT_128K_S = 15.0
SETUP_S = 20.0


def estimate_s(run: dict, rows: list[dict], setup_s: float = SETUP_S) -> float:
    """Seconds ``run`` should take: set-up, its prefill scaled from the longest measured context of
    its mode (else of any mode, else :data:`PRIOR_TTFT_128K_S`) as half linear (the weights) and
    half quadratic (dense heads' attention) in the context, and its decode steps."""
    ctx = run["context"]
    done = [r for r in rows if not r.get("cut")]
    ref = max((r for r in done if r["mode"] == run["mode"]), key=lambda r: r["context"], default=None) \
        or max(done, key=lambda r: r["context"], default=None)
    ttft, ms, c0 = (ref["ttft_s"], ref["decode_ms_per_token"], ref["context"]) if ref else \
        (PRIOR_TTFT_128K_S, 10.0, 131072)
    r = ctx / c0
    return setup_s + ttft * (0.5 * r + 0.5 * r * r) + DECODE_STEPS * ms * r / 1e3


def _measure(eng, run: dict, t_start: float, deadline_s: float) -> dict:
    """Prefill one random prompt of the run's context chunk by chunk (a progress line each), then
    decode: TTFT, median decode ms/token, prefill chunks; a ``cut`` row (tokens prefilled,
    seconds) when the deadline passes during the prefill."""
    from lserve.engine import SamplingParams

    ctx = run["context"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, eng.model_config.vocab_size - 2, (ctx,), generator=g).tolist()
    rid = eng.add_request(ids, SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0, ignore_eos=True))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = last = time.perf_counter()
    chunks = 0
    while True:
        outs = eng.step()
        chunks += 1
        now = time.perf_counter()
        seq = eng.sequence(rid)
        done = seq.num_computed if seq is not None else ctx
        st = eng.stats().host_kv
        print(f"[{now - t_start:6.0f}s]   chunk {chunks}: {done}/{ctx} tokens, {now - last:.2f} s"
              + (f", prefill H2D {st.prefill_bytes_h2d / 2**30:.1f} GiB in {st.h2d_copies} copies" if st else ""),
              flush=True)
        last = now
        if any(o.token_ids for o in outs):
            break
        if now - t_start > deadline_s:
            eng.abort(rid)
            return {"cut": True, "prefilled_tokens": done, "prefill_s": now - t0, "prefill_chunks": chunks}
    ttft = time.perf_counter() - t0
    steps = []
    while eng.has_unfinished():
        t1 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t1)
    return {"ttft_s": ttft, "decode_ms_per_token": statistics.median(steps) * 1e3, "prefill_chunks": chunks}


def _engine(loaded, run: dict, sp):
    from lserve.engine.llm_engine import LLMEngine

    ctx = run["context"]
    tokens = run["resident_tokens"] or ctx + DECODE_STEPS + 1024
    cache = CacheConfig(dense_pool_tokens=tokens, kv_quant="int4", host_kv_gib=run["host_kv_gib"])
    cfg = EngineConfig(model="llama3-8b", sparsity=sp, cache=cache, device="cuda", backend="cupy", max_num_seqs=1,
                       max_batched_tokens=8192, max_model_len=ctx + DECODE_STEPS + 1024,
                       allow_long_max_model_len=True)
    return LLMEngine(cfg, loaded)


def run(out_dir: str | Path, contexts=CONTEXTS, resident_tokens: int = 65536, deadline_s: float = 500.0,
        reserve_gib: float = 8.0) -> dict:
    from lserve.bench.e2e import CONFIGS, kv_bytes_per_token
    from lserve.models.loader import load_model

    t0 = time.perf_counter()
    out = Path(out_dir)
    sp = CONFIGS["lserve"]
    loaded = load_model("llama3-8b", dtype=torch.bfloat16, device="cuda")
    per_token = kv_bytes_per_token(loaded, "llama3-8b", sp, "cuda", "int4")
    gpu_bytes = torch.cuda.mem_get_info()[0] - reserve_gib * 2**30
    host_bytes = psutil.virtual_memory().available * 0.8
    report = {**header(), "model": "llama3-8b", "kv_quant": "int4", "sparsity": "lserve", "decode_steps": DECODE_STEPS,
              "kv_bytes_per_token": per_token, "host_bytes_available": host_bytes, "gpu_bytes_for_kv": gpu_bytes,
              "max_context_gpu": int(gpu_bytes // per_token), "rows": [], "skipped": []}
    path = out / "host_tier_h200.json"
    setup = SETUP_S
    for r in plan_runs(contexts, gpu_bytes, per_token, host_bytes, resident_tokens):
        elapsed = time.perf_counter() - t0
        est = estimate_s(r, report["rows"], setup)
        if elapsed + est > deadline_s:
            report["skipped"].append({**r, "estimate_s": round(est)})
            print(f"[{elapsed:6.0f}s] skip {r['mode']} {r['context']} (needs ~{est:.0f} s, deadline)", flush=True)
            continue
        print(f"[{elapsed:6.0f}s] {r['mode']} context {r['context']} host {r['host_kv_gib']} GiB (~{est:.0f} s)",
              flush=True)
        t_run = time.perf_counter()
        eng = _engine(loaded, r, sp)
        setup = time.perf_counter() - t_run
        row = {**r, **_measure(eng, r, t0, deadline_s)}
        st = eng.stats().host_kv
        if st is not None:
            row.update(hit_rate=st.hit_rate, h2d_bytes_total=st.bytes_h2d, h2d_bytes_last_step=st.step_bytes_h2d,
                       d2h_bytes_total=st.bytes_d2h, fetched=st.fetched, streamed=st.streamed, spilled=st.spilled,
                       prefill_streamed=st.prefill_streamed, prefill_bytes_h2d=st.prefill_bytes_h2d,
                       h2d_copies=st.h2d_copies, virtual_tokens=eng.cache.dense_alloc.num_pages * eng.cache.page_size)
            eng.cache.host_tier.check()
        report["rows"].append(row)
        if row.get("cut"):
            print(f"    cut at the deadline: {row['prefilled_tokens']} tokens in {row['prefill_s']:.1f} s", flush=True)
        else:
            print(f"    decode {row['decode_ms_per_token']:.2f} ms/token, ttft {row['ttft_s']:.1f} s"
                  + (f", hit rate {st.hit_rate:.3f}, prefill H2D {st.prefill_bytes_h2d / 2**30:.2f} GiB "
                     f"({st.prefill_streamed} pages, {st.h2d_copies} copies)" if st else ""), flush=True)
        write_json(path, report)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    tier_rows = [x for x in report["rows"] if x["mode"] == "tier" and not x.get("cut")]
    # one request holds the tier's virtual pages: the host's memory (as sized) plus the resident set
    report["max_context_tier"] = int(host_bytes // (per_token * 1.1)) + resident_tokens
    report["max_context_tier_measured"] = max((x["context"] for x in tier_rows), default=0)
    write_json(path, report)
    plot(report, out / "host_tier_h200.png")
    print(f"wrote {path}", flush=True)
    return report


def plot(report: dict, path: Path) -> None:
    """Decode ms/token vs context, tier and all-GPU; the command, device and date in the title."""
    from lserve.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, label in (("tier", "host KV tier"), ("gpu", "all-GPU")):
        rows = sorted((x for x in report["rows"] if x["mode"] == mode and not x.get("cut")), key=lambda x: x["context"])
        if rows:
            ax.plot([x["context"] for x in rows], [x["decode_ms_per_token"] for x in rows], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode ms / token")
    ax.legend()
    ax.set_title(f"{report['model']} INT4 KV, {report['device']}, {report['date']}\n{report['command']}", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lserve.bench.host_tier", description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--resident-tokens", type=int, default=65536)
    p.add_argument("--deadline", type=float, default=500.0, help="seconds; later runs are skipped")
    a = p.parse_args(argv)
    run(a.out, tuple(int(c) for c in a.contexts.split(",")), a.resident_tokens, a.deadline)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
