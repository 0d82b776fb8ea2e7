"""Host KV tier on the cupy backend (issue 39): decode ms/token vs context with the tier and all-GPU.

``python -m lserve.bench.host_tier OUT [--contexts 131072,524288,1048576] [--resident-tokens 65536]
[--prefill-sparsity TAU] [--max-batched-tokens 8192] [--deadline 500]``: llama3-8b preset (random
weights), LServe sparsity, INT4 KV. Per context, one request of that many tokens with the dense pool
cut to ``--resident-tokens`` and the rest in the host tier, and the all-GPU engine where its pool
fits beside the weights; both prefill alike (``--prefill-sparsity``: block-sparse prefill's tau,
"auto" the engine's default; rows carry the kept fraction of causal tiles where it ran). Rows carry
decode ms/token, TTFT, H2D bytes and the hit rate; the report also holds the longest context one
request can hold with the tier (its virtual pages) against all-GPU. Writes
``OUT/NAME.json`` after every run and ``OUT/NAME.png`` (``--name``, default ``host_tier_h200``;
``--modes tier`` or ``gpu`` runs one of the two). Runs go shortest
context first (tier, then all-GPU), so a cut loses the longest; a run whose estimated time
(:mod:`lserve.bench.host_tier_time`) would pass the deadline is listed as skipped, and one that
passes it while prefilling is aborted and kept as a ``cut`` row (tokens prefilled, seconds).
Progress lines (one per prefill chunk) go to stdout. ``--concurrency``: many 128k sequences at
once instead (:mod:`lserve.bench.host_tier_concurrency`); ``--capacity``: the longest context each
mode's engine builds and admits, nothing prefilled (:mod:`lserve.bench.host_tier_capacity`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lserve.bench.host_tier_common import (
    ADMISSIONS,
    CONTEXTS,
    DECODE_STEPS,
    WARMUP_STEPS,
    Settings,
    Setup,
    free_memory,
    host_kv_row,
    make_engine,
    profile_decode,
    profile_host,
    setup,
)
from lserve.bench.host_tier_sizes import max_context
from lserve.bench.report import header, write_json
from lserve.config import KV_QUANT_CHOICES, ConfigError, parse_prefill_sparsity


def plan_runs(contexts, gpu_bytes: float, bytes_per_token: float, host_bytes: float, resident_tokens: int,
              margin: float = 1.1, decode_steps: int = DECODE_STEPS, modes=("tier", "gpu")) -> list[dict]:
    """The runs to make: per context a tier run (where the host holds it) and an all-GPU run (where
    its pool fits ``gpu_bytes``), each with the host GiB it needs (0 all-GPU); ``modes`` keeps those named."""
    runs = []
    for ctx in sorted(contexts):  # shortest first: a deadline cuts the longest
        need = (ctx + decode_steps + 1024) * bytes_per_token * margin
        if "tier" in modes and need <= host_bytes:
            runs.append({"mode": "tier", "context": ctx, "host_kv_gib": round(need / 2**30, 6),
                         "resident_tokens": resident_tokens})
        if "gpu" in modes and need <= gpu_bytes:
            runs.append({"mode": "gpu", "context": ctx, "host_kv_gib": 0.0, "resident_tokens": 0})
    return runs


def _measure(eng, run: dict, t_start: float, deadline_s: float, decode_steps: int = DECODE_STEPS,
             profile_steps: int = 0, host_profile_steps: int = 0) -> dict:
    """Prefill one random prompt of the run's context chunk by chunk (a progress line each), then
    decode: TTFT, median decode ms/token, prefill chunks and, where block-sparse prefill ran, the
    kept fraction of its causal tiles; a ``cut`` row (tokens prefilled, seconds) when the
    deadline passes during the prefill. ``profile_steps``: that many decode steps more, after the
    timed ones, under a CUDA trace (:func:`profile_decode`); ``host_profile_steps``: that many more
    under cProfile (:func:`profile_host`). Each timed step keeps its kind (``graph``: a CUDA-graph
    replay, ``decode_eager``) and the pages the tier installed in it."""
    from lserve.engine import SamplingParams

    ctx = run["context"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, eng.model_config.vocab_size - 2, (ctx,), generator=g).tolist()
    # 4 tokens to spare: the request finishes (and frees its pages) after the profiled steps
    rid = eng.add_request(ids, SamplingParams(max_tokens=decode_steps + 5 + profile_steps + host_profile_steps,
                                              temperature=0,
                                              ignore_eos=True))
    tiles0 = list(eng.backend.prefill_tiles)
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
    kept = eng.backend.prefill_kept_since(tiles0)
    steps, kinds, fetched = [], [], []
    graphs = getattr(eng, "graphs", None)
    if graphs is not None:  # CUDA events around each replay: the GPU's own time of a step
        graphs.events = []
    while eng.has_unfinished() and len(steps) < decode_steps:
        before = _step_counts(eng)
        t1 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t1)
        kind, n = _step_counts(eng)
        kinds.append("+".join(sorted(k for k in kind if kind[k] > before[0].get(k, 0))))
        fetched.append(n - before[1])
    replay = graphs.replay_ms() if graphs is not None else []
    if graphs is not None:
        graphs.events = None
    prof = profile_decode(eng, profile_steps) if profile_steps and eng.has_unfinished() else {}
    if host_profile_steps and eng.has_unfinished():
        prof.update(profile_host(eng, host_profile_steps))
    rest = 0
    while eng.has_unfinished():
        eng.step()
        rest += 1
    # the decode's share of the tier's counters (h2d_bytes_total less prefill_bytes_h2d) is over these
    decode_steps_run = len(steps) + prof.get("profiled_steps", 0) + prof.get("host_profiled_steps", 0) + rest
    # the median step is the rows' figure since session 19, but it leaves out the steps that
    # fetch a selection's picks (one in the reuse interval; 34 ms against 3-7 at 1M on an H100,
    # session 29): the steady mean is the figure to judge. The first decode steps run eager and
    # capture the decode graphs (one per key: selecting and reusing steps; up to 3.9 s at 1M):
    # the steady mean leaves out the first 8 (with 32 timed, the other 24 are whole reuse
    # intervals of 4); every step is kept
    steady = steps[WARMUP_STEPS:] if len(steps) >= 2 * WARMUP_STEPS else steps[2:] or steps
    return {"ttft_s": ttft, "decode_ms_per_token": statistics.median(steps) * 1e3,
            "decode_ms_mean": statistics.fmean(steps) * 1e3, "decode_ms_max": max(steps) * 1e3,
            "decode_ms_steady_mean": statistics.fmean(steady) * 1e3,
            "decode_step_ms": [round(t * 1e3, 3) for t in steps], "decode_step_kind": kinds,
            "decode_step_fetched": fetched, "decode_replay_ms": [round(t, 3) for t in replay],
            "decode_replay_ms_median": statistics.median(replay) if replay else None, "prefill_chunks": chunks,
            "decode_steps_run": decode_steps_run,
            **({"prefill_kept_fraction": kept} if kept is not None else {}), **prof}


def _step_counts(eng) -> tuple[dict, int]:
    """The engine's steps by kind so far and the pages its host tier has installed (0: no tier);
    read between timed steps, so not through ``eng.stats()`` (its tier gauges cost ~1-2 ms of host
    time at 1M tokens, which async decode would add to the steps)."""
    tier = eng.cache.host_tier
    return dict(eng.step_kinds), (tier.fetched_pages if tier is not None else 0)


def run(settings: Settings, out_dir: str | Path) -> dict:
    """The single-request rows (module docstring); returns the report written."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    st = setup(settings)
    s, sizes = settings, st.sizes
    report = {**header(), **st.header(), "rows": [], "skipped": []}
    path = out / f"{s.name}.json"
    runs = plan_runs(s.contexts, st.gpu_bytes, sizes.device_per_token, st.host_bytes, s.resident_tokens,
                     decode_steps=s.decode_steps, modes=s.modes)
    for r in runs:
        r["prefill_sparsity"] = st.prefill_tau
        elapsed = time.perf_counter() - t0
        est = st.time.estimate_s(r, report["rows"], s.decode_steps)
        if elapsed + est > s.deadline_s:
            report["skipped"].append({**r, "estimate_s": round(est)})
            print(f"[{elapsed:6.0f}s] skip {r['mode']} {r['context']} (needs ~{est:.0f} s, deadline)", flush=True)
            continue
        print(f"[{elapsed:6.0f}s] {r['mode']} context {r['context']} host {r['host_kv_gib']} GiB (~{est:.0f} s)",
              flush=True)
        t_run = time.perf_counter()
        eng = _engine(st, r)
        row = {**r, **_measure(eng, r, t0, s.deadline_s, s.decode_steps, s.profile_steps, s.host_profile_steps),
               **host_kv_row(eng)}
        row.update(estimate_s=round(est, 1), wall_s=round(time.perf_counter() - t_run, 1))
        report["rows"].append(row)
        _print_row(row)
        write_json(path, report)
        del eng
        free_memory()
    tier_rows = [x for x in report["rows"] if x["mode"] == "tier" and not x.get("cut")]
    # one request holds the tier's virtual pages: the host's memory (as sized) plus the resident set
    report["max_context_tier"] = int(st.host_bytes // (sizes.device_per_token * 1.1)) + s.resident_tokens
    report["max_context_tier_measured"] = max((x["context"] for x in tier_rows), default=0)
    # the same with the resident set as large as the device allows (key statistics stay on it)
    report["max_context_tier_full_device"] = max_context(sizes, st.gpu_bytes, st.host_bytes, s.max_batched_tokens)["tier"]
    write_json(path, report)
    plot(report, out / f"{s.name}.png")
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s", flush=True)
    return report


def _engine(st: Setup, run: dict):
    ctx, steps = run["context"], st.settings.decode_steps
    tokens = run["resident_tokens"] or ctx + steps + 1024
    return make_engine(st, tokens, run["host_kv_gib"], 1, ctx + steps + 1024)


def _print_row(row: dict) -> None:
    if row.get("cut"):
        print(f"    cut at the deadline: {row['prefilled_tokens']} tokens in {row['prefill_s']:.1f} s", flush=True)
        return
    if row.get("profiled_steps"):
        top = ", ".join(f"{k[:40]} {v:.3f}" for k, v in list(row["profiled_kernel_ms_per_step"].items())[:5])
        print(f"    profiled {row['profiled_steps']} decode steps: wall {row['profiled_wall_ms_per_step']:.2f} ms, "
              f"GPU busy {row['profiled_gpu_busy_ms_per_step']:.2f} ms a step; GPU ms a step: {top}", flush=True)
    if row.get("host_profiled_steps"):
        top = ", ".join(f"{k} {v:.3f}" for k, v in list(row["host_tottime_ms_per_step"].items())[:8])
        print(f"    cProfile {row['host_profiled_steps']} decode steps: wall {row['host_profiled_wall_ms_per_step']:.2f} ms "
              f"a step; host ms a step (own time): {top}", flush=True)
    kept = row.get("prefill_kept_fraction")
    print(f"    decode {row['decode_ms_per_token']:.2f} ms/token (median step; mean {row['decode_ms_mean']:.2f}, "
          f"steady mean {row['decode_ms_steady_mean']:.2f}, "
          f"max {row['decode_ms_max']:.2f}"
          + (f"; GPU replay median {row['decode_replay_ms_median']:.2f}" if row.get("decode_replay_ms_median") else "")
          + f"), ttft {row['ttft_s']:.1f} s"
          + (f", kept {kept:.3f} of causal tiles" if kept is not None else "")
          + (f", hit rate {row['hit_rate']:.3f}, prefill H2D {row['prefill_bytes_h2d'] / 2**30:.2f} GiB "
             f"({row['prefill_streamed']} pages, {row['h2d_copies']} copies)" if "hit_rate" in row else "")
          + f"; run {row['wall_s']:.0f} s (estimated {row['estimate_s']:.0f} s)", flush=True)


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
    if ax.get_lines():
        ax.legend()
    ax.set_title(f"{report['model']} {report.get('kv_quant', 'int4')} KV, {report['device']}, {report['date']}\n"
                 f"{report['command']}", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> tuple[Settings, str]:
    """Settings and the output folder from the command line; bad values exit 2 with one error line."""
    p = argparse.ArgumentParser(prog="python -m lserve.bench.host_tier", description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="tokens per request (comma-separated)")
    p.add_argument("--resident-tokens", type=int, default=65536, help="the tier's device-resident set (single mode)")
    p.add_argument("--deadline", type=float, default=500.0, help="seconds; runs estimated past it are skipped")
    p.add_argument("--prefill-sparsity", default="auto",
                   help="block-sparse prefill tau in [0, 1] for both modes (0: off), or 'auto' (the engine's default)")
    p.add_argument("--max-batched-tokens", type=int, default=8192, help="the engine's token cap per step")
    p.add_argument("--kv-quant", default="int4", choices=KV_QUANT_CHOICES, help="KV storage (none: bf16 on a GPU)")
    p.add_argument("--concurrency", action="store_true",
                   help="N sequences per context decoding together: the all-GPU and the tier's most N, tok/s")
    p.add_argument("--capacity", action="store_true",
                   help="the longest context one sequence holds, all-GPU and with the tier: each engine built, nothing prefilled")
    p.add_argument("--gpu-kv-gib", type=float, default=0.0, help="device memory for KV (0: free memory less 8 GiB)")
    p.add_argument("--host-kv-gib", type=float, default=0.0,
                   help="host memory the tier may take (0: 80%% of what the host has available)")
    p.add_argument("--decode-steps", type=int, default=DECODE_STEPS, help="decode steps timed per run")
    p.add_argument("--model", default="llama3-8b", help="a preset (random weights)")
    p.add_argument("--device", default="cuda", help="cuda (cupy backend) or cpu (torch backend)")
    p.add_argument("--modes", default="tier,gpu", help="single mode: which runs per context (tier, gpu or both)")
    p.add_argument("--name", default="host_tier_h200", help="single mode: the report's file stem under OUT")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="decode steps traced after the timed ones (GPU busy vs wall, GPU ms per kernel)")
    p.add_argument("--host-profile-steps", type=int, default=0,
                   help="decode steps run under cProfile after those (host ms a step per function)")
    p.add_argument("--admission", default="repeat", choices=ADMISSIONS,
                   help="which missed picks enter the tier's resident set: repeat (picked by 2+ heads or again), all")
    a = p.parse_args(argv)
    try:
        contexts = tuple(int(c) for c in a.contexts.split(","))
        s = Settings(contexts, a.resident_tokens, a.deadline, parse_prefill_sparsity(a.prefill_sparsity),
                     a.max_batched_tokens, a.kv_quant, a.gpu_kv_gib, a.host_kv_gib, decode_steps=a.decode_steps,
                     concurrency=a.concurrency, capacity=a.capacity, model=a.model, device=a.device,
                     modes=tuple(m for m in a.modes.split(",") if m), name=a.name, admission=a.admission,
                     profile_steps=a.profile_steps, host_profile_steps=a.host_profile_steps)
    except ValueError as e:  # ConfigError too
        p.error(str(e) if isinstance(e, ConfigError) else f"--contexts must be integers, got {a.contexts!r}")
    return s, a.out


def main(argv=None) -> int:
    s, out = parse_args(argv)
    if s.concurrency:
        from lserve.bench.host_tier_concurrency import run as run_concurrency

        run_concurrency(s, out)
    elif s.capacity:
        from lserve.bench.host_tier_capacity import run as run_capacity

        run_capacity(s, out)
    else:
        run(s, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
