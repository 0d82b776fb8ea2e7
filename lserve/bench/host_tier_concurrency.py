"""Sequences a replica holds at one long context with and without the host KV tier, and the
output tokens/s they decode at (issue 39 target b).

``python -m lserve.bench.host_tier OUT --concurrency --kv-quant none --contexts 131072
[--host-kv-gib G] [--gpu-kv-gib D] [--prefill-sparsity TAU]``: per context, the all-GPU engine
with the most sequences its pool admits and the tier's engine with the most its resident set and
``G`` GiB of host pages admit (:mod:`lserve.bench.host_tier_sizes`; each engine's own allocators
then say how many it admits, and that many run). Every sequence has its own random prompt and no
prefix cache, so each holds all its pages. Sequences prefill one after another (the scheduler's
order) while the earlier ones decode; once all decode together, ``--decode-steps`` steps are timed:
output tokens/s, ms per step, the tier's hit rate and H2D bytes per step. A run that does not hold
all its sequences at once (a preemption, one left waiting) is kept with ``held_all: false``.
Writes ``OUT/host_tier_concurrency.json`` after every run.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from lserve.bench.host_tier_common import (
    WARMUP_STEPS,
    Setup,
    admits,
    free_memory,
    host_kv_row,
    make_engine,
    overhead_bytes,
    profile_decode,
    profile_host,
    setup,
)
from lserve.bench.host_tier_sizes import engine_pools, seqs_all_gpu, seqs_tier
from lserve.bench.host_tier_time import prefill_chunks
from lserve.bench.report import header, write_json


def decode_slack(st: Setup, context: int, n_seqs: int, mode: str) -> int:
    """Tokens the first sequence may decode before the timed steps end: one per step while the
    others prefill (chunks as the scheduler cuts them next to up to ``n_seqs`` decodes), plus the
    warm-up, timed (and profiled) steps and two."""
    alpha = 0.0 if mode == "tier" else st.time.alpha
    s = st.settings
    chunks = len(prefill_chunks(context, s.max_batched_tokens, alpha, n_decode=n_seqs))
    return max(n_seqs - 1, 0) * (chunks + 1) + WARMUP_STEPS + s.decode_steps + s.profile_steps + s.host_profile_steps + 2


def plan(st: Setup, context: int) -> list[dict]:
    """The all-GPU and tier runs at ``context``: sequences, pools and host GiB from the byte
    arithmetic, each sequence sized for its prompt and :func:`decode_slack`."""
    s, sz, mbt = st.settings, st.sizes, st.settings.max_batched_tokens
    runs = []
    for mode in ("gpu", "tier"):
        count = (lambda t: seqs_all_gpu(sz, st.gpu_bytes, t)) if mode == "gpu" else \
            (lambda t: seqs_tier(sz, st.gpu_bytes, st.host_bytes, t, mbt))
        n = count(context + s.decode_steps + 2)
        tokens = context + decode_slack(st, context, n, mode)
        n = count(tokens)  # fewer sequences decode less while the others prefill: the slack still holds
        if n < 1:
            runs.append({"mode": mode, "context": context, "n_seqs": 0, "seq_tokens": tokens})
            continue
        pool, host_gib = engine_pools(sz, st.gpu_bytes, st.host_bytes, n, mbt, tier=mode == "tier")
        runs.append({"mode": mode, "context": context, "n_seqs": n, "seq_tokens": tokens, "pool_tokens": pool,
                     "host_kv_gib": host_gib})
    return runs


def _measure(eng, n: int, run: dict, t_start: float, deadline_s: float, decode_steps: int,
             profile_steps: int = 0, host_profile_steps: int = 0) -> dict:
    """Prefill ``n`` distinct random prompts (a progress line as each starts decoding), then, after
    :data:`~lserve.bench.host_tier_common.WARMUP_STEPS` untimed steps, time ``decode_steps`` steps
    of all of them decoding together, then run ``profile_steps`` under a
    CUDA trace and ``host_profile_steps`` under cProfile (GPU busy against wall, host time by
    function: what bounds a step); aborts them all at the end."""
    from lserve.engine import SamplingParams

    ctx, vocab = run["context"], eng.model_config.vocab_size - 2
    params = SamplingParams(max_tokens=run["seq_tokens"] - ctx, temperature=0, ignore_eos=True)
    rids = [eng.add_request(torch.randint(0, vocab, (ctx,), generator=torch.Generator().manual_seed(i)).tolist(),
                            params) for i in range(n)]
    t0 = time.perf_counter()
    started: set[str] = set()
    while len(started) < n:
        for o in eng.step():
            if o.token_ids and o.request_id not in started:
                started.add(o.request_id)
                now = time.perf_counter()
                print(f"[{now - t_start:6.0f}s]   {len(started)}/{n} decoding ({o.request_id} after {now - t0:.1f} s)",
                      flush=True)
        if not eng.has_unfinished():
            break  # a sequence finished early: cannot happen with the slack, kept as not held
        if time.perf_counter() - t_start > deadline_s:
            for r in rids:
                eng.abort(r)
            return {"cut": True, "decoding": len(started), "prefill_s": time.perf_counter() - t0}
    all_prefill_s = time.perf_counter() - t0
    stats = eng.stats()
    row = {"all_prefill_s": all_prefill_s, "running": stats.running, "preemptions": stats.num_preemptions}
    for _ in range(WARMUP_STEPS):  # the batch's first steps: eager, and its CUDA graphs captured
        eng.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    stats = eng.stats()  # counted from here: the timed steps' tokens and bytes only
    host0 = stats.host_kv
    gen0 = stats.generation_tokens
    t1 = time.perf_counter()
    for _ in range(decode_steps):
        eng.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t1
    stats = eng.stats()
    row.update(decode_ms_per_step=dt / decode_steps * 1e3, output_tok_s=(stats.generation_tokens - gen0) / dt,
               held_all=row["running"] == n and stats.running == n and stats.num_preemptions == 0)
    if stats.host_kv:
        row["h2d_bytes_per_decode_step"] = (stats.host_kv.bytes_h2d - host0.bytes_h2d) / decode_steps
        row["staged_parts_per_decode_step"] = (stats.host_kv.staged_parts - host0.staged_parts) / decode_steps
    if profile_steps:
        row.update(profile_decode(eng, profile_steps))
    if host_profile_steps:
        row.update(profile_host(eng, host_profile_steps))
    for r in rids:
        eng.abort(r)
    row["freed"] = eng.cache.all_free()
    return row


def run(settings, out_dir: str | Path) -> dict:
    """Both modes per context (all-GPU first); returns the report written."""
    t0 = time.perf_counter()
    # engines load their own weights (the bench holds none, as a replica); without --gpu-kv-gib the
    # device budget is what is free less one engine's measured overhead (weights included)
    st = setup(settings, keep_weights=False)
    s = settings
    over = 0.0
    if not s.gpu_kv_gib:
        over, _ = overhead_bytes(st, max(s.contexts) + s.decode_steps + 2 + st.sizes.page_size)
        st = replace(st, gpu_bytes=st.gpu_bytes - over)
    path = Path(out_dir) / "host_tier_concurrency.json"
    report = {**header(), **st.header(), "mode": "concurrency", "ring_bytes_per_seq": st.sizes.ring_per_seq,
              "engine_overhead_gib": round(over / 2**30, 3),
              "rows": [], "skipped": []}
    for ctx in sorted(s.contexts):
        for r in plan(st, ctx):
            elapsed = time.perf_counter() - t0
            if r["n_seqs"] < 1:
                report["skipped"].append({**r, "why": "not one sequence fits"})
                continue
            est = _estimate_s(st, r)
            if elapsed + est > s.deadline_s:
                report["skipped"].append({**r, "estimate_s": round(est)})
                print(f"[{elapsed:6.0f}s] skip {r['mode']} x{r['n_seqs']} at {ctx} (needs ~{est:.0f} s)", flush=True)
                continue
            print(f"[{elapsed:6.0f}s] {r['mode']} {r['n_seqs']} x {ctx} tokens, pool {r['pool_tokens']} tokens, "
                  f"host {r['host_kv_gib']:.2f} GiB (~{est:.0f} s)", flush=True)
            t_run = time.perf_counter()
            eng = make_engine(st, r["pool_tokens"], r["host_kv_gib"], r["n_seqs"], r["seq_tokens"] + st.sizes.page_size)
            n = admits(eng, r["seq_tokens"])
            row = {**r, "n_seqs_planned": r["n_seqs"], "n_seqs": n,
                   **_measure(eng, n, r, t0, s.deadline_s, s.decode_steps, s.profile_steps, s.host_profile_steps),
                   **host_kv_row(eng)}
            row.update(estimate_s=round(est, 1), wall_s=round(time.perf_counter() - t_run, 1))
            report["rows"].append(row)
            if not row.get("cut"):
                print(f"    {n} sequences: {row['output_tok_s']:.1f} tok/s, {row['decode_ms_per_step']:.2f} ms/step"
                      + (f", hit rate {row['hit_rate']:.3f}, H2D {row['h2d_bytes_per_decode_step'] / 2**20:.1f} "
                         "MiB/step" if "hit_rate" in row else "")
                      + f"; held all: {row['held_all']}", flush=True)
                if row.get("profiled_steps"):
                    print(f"    profiled {row['profiled_steps']} steps: wall {row['profiled_wall_ms_per_step']:.1f} ms, "
                          f"GPU busy {row['profiled_gpu_busy_ms_per_step']:.1f} ms a step", flush=True)
                if row.get("host_profiled_steps"):
                    top = ", ".join(f"{k} {v:.2f}" for k, v in list(row["host_cumtime_ms_per_step"].items())[:8])
                    print(f"    cProfile {row['host_profiled_steps']} steps: host ms a step (cumulative): {top}", flush=True)
            write_json(path, report)
            del eng
            free_memory()
    report["ratios"] = ratios(report["rows"])
    write_json(path, report)
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s", flush=True)
    return report


def _estimate_s(st: Setup, r: dict) -> float:
    """Every sequence's prefill (the resident set shared among them), the timed steps at the
    prior ms/token per sequence, set-up."""
    one = {"mode": r["mode"], "context": r["context"], "resident_tokens": r["pool_tokens"] // r["n_seqs"],
           "host_kv_gib": 0.0, "prefill_sparsity": st.prefill_tau}
    per = st.time.estimate_s(one, [], 0)
    return per * r["n_seqs"] + st.settings.decode_steps * r["n_seqs"] * 0.01


def ratios(rows: list[dict]) -> dict:
    """Per context: tier / all-GPU sequences held and output tokens/s (runs that held them all)."""
    out = {}
    for ctx in sorted({r["context"] for r in rows}):
        by = {r["mode"]: r for r in rows if r["context"] == ctx and r.get("held_all")}
        if "gpu" in by and "tier" in by:
            out[str(ctx)] = {"seqs": by["tier"]["n_seqs"] / by["gpu"]["n_seqs"],
                             "output_tok_s": by["tier"]["output_tok_s"] / by["gpu"]["output_tok_s"]}
    return out
