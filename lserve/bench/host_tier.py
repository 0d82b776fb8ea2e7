"""Host KV tier on the cupy backend (issue 39): decode ms/token vs context with the tier and all-GPU.

``python -m lserve.bench.host_tier OUT [--contexts 131072,524288,1048576] [--resident-tokens 65536]
[--deadline 500]``: llama3-8b preset (random weights), LServe sparsity, INT4 KV. Per context, one
request of that many tokens with the dense pool cut to ``--resident-tokens`` and the rest in the
host tier, and the all-GPU engine where its pool fits beside the weights. Rows carry decode
ms/token, TTFT, H2D bytes per decode step and the hit rate; the report also holds the longest
context one request can hold with the tier (its virtual pages) against all-GPU. Writes
``OUT/host_tier_h200.json`` after every run and ``OUT/host_tier_h200.png``; runs that would start
past the deadline are listed as skipped. Progress lines go to stdout.
"""

from __future__ import annotations

import argparse
import gc
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
    for ctx in contexts:
        need = (ctx + DECODE_STEPS + 1024) * bytes_per_token * margin
        if need <= host_bytes:
            runs.append({"mode": "tier", "context": ctx, "host_kv_gib": round(need / 2**30, 2),
                         "resident_tokens": resident_tokens})
        if need <= gpu_bytes:
            runs.append({"mode": "gpu", "context": ctx, "host_kv_gib": 0.0, "resident_tokens": 0})
    return runs


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
    from lserve.bench.e2e import CONFIGS, kv_bytes_per_token, measure_engine
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
    for r in plan_runs(contexts, gpu_bytes, per_token, host_bytes, resident_tokens):
        elapsed = time.perf_counter() - t0
        # a run costs about its prefill (~30 s per 128k tokens, measured on the e2e bench) plus set-up
        if elapsed + 30 * r["context"] / 131072 + 20 > deadline_s:
            report["skipped"].append(r)
            print(f"[{elapsed:6.0f}s] skip {r['mode']} {r['context']} (deadline)", flush=True)
            continue
        print(f"[{elapsed:6.0f}s] {r['mode']} context {r['context']} host {r['host_kv_gib']} GiB", flush=True)
        eng = _engine(loaded, r, sp)
        ttft, per = measure_engine(eng, r["context"], DECODE_STEPS)
        row = {**r, "ttft_s": ttft, "decode_ms_per_token": per * 1e3}
        st = eng.stats().host_kv
        if st is not None:
            row.update(hit_rate=st.hit_rate, h2d_bytes_total=st.bytes_h2d, h2d_bytes_last_step=st.step_bytes_h2d,
                       d2h_bytes_total=st.bytes_d2h, fetched=st.fetched, streamed=st.streamed, spilled=st.spilled,
                       virtual_tokens=eng.cache.dense_alloc.num_pages * eng.cache.page_size)
            eng.cache.host_tier.check()
        report["rows"].append(row)
        print(f"    decode {row['decode_ms_per_token']:.2f} ms/token, ttft {ttft:.1f} s"
              + (f", hit rate {st.hit_rate:.3f}, last-step H2D {st.step_bytes_h2d / 2**20:.1f} MiB" if st else ""),
              flush=True)
        write_json(path, report)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    tier_rows = [x for x in report["rows"] if x["mode"] == "tier"]
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
        rows = sorted((x for x in report["rows"] if x["mode"] == mode), key=lambda x: x["context"])
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
