"""Where time goes in the engine's steps: torch.profiler over a prefill step and over the decode
steps of a batch, and the decode step's wall time beside its kernels' time.

    python scripts/profile_steps.py OUT_DIR [--model llama3-8b] [--config lserve] [--context 32768]
                                    [--batch 1 16] [--steps 8] [--device cuda|cpu]

Writes ``profile_<config>_<context>[_b<N>-...].json`` and prints the tables:

* ``prefill``: kernels of one prompt of ``--context`` tokens prefilled in one step;
* per ``--batch N`` (``batches``): ``N`` sequences decoding together at ``--context``
  (``lserve.bench.decode_step``: distinct prompts up to 8k, one shared prompt past it), profiled
  over ``--steps`` eager steps (no CUDA graph, so every kernel is attributed; kernel durations are
  those inside a graph, launch gaps are not): ``kernels`` by GPU time per step and their sum
  ``kernel_ms``; ``eager_step_ms``, the same steps' median wall time unprofiled; ``step_ms``, the mean step as
  the served engine runs it (CUDA-graph replay, async decode), unprofiled; ``host_gap_ms`` =
  ``step_ms - kernel_ms``, the part of a served decode step in which no kernel of it runs
  (host work the device waits for), and ``eager_host_gap_ms`` likewise.

On a CPU (``--device cpu``, a smoke test) the "kernels" are the torch ops by self CPU time.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lserve.bench.decode_step import (
    decode_engine,
    decode_step_s,
    output_tokens,
    random_prompt,
    start_batch,
    sync,
    timed_steps,
)
from lserve.bench.e2e import CONFIGS
from lserve.bench.report import header
from lserve.engine.sampling import SamplingParams
from lserve.models.loader import load_model

WARMUP = 4  # decode steps before anything is profiled or timed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--config", default="lserve", choices=list(CONFIGS))
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, nargs="+", default=[1], metavar="N",
                    help="sequences decoding together (several values: one profile each)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    if min(a.batch) < 1 or a.steps < 1 or a.context < 16:
        ap.error("--batch and --steps must be >= 1, --context >= 16")
    cuda = a.device.startswith("cuda")
    backend = "cupy" if cuda else "torch"
    loaded = load_model(a.model, dtype=torch.bfloat16 if cuda else torch.float32, device=a.device)
    sp = CONFIGS[a.config]
    eager = decode_engine(loaded, a.model, sp, a.context, max(a.batch), a.device, backend,
                          steps=2 * a.steps, warmup=WARMUP, cuda_graphs=False)
    # the prefill: the first prompt of every batch below (past 8k its pages are then reused)
    eager.add_request(random_prompt(eager, a.context, 0), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    sync(a.device)
    t0 = time.perf_counter()
    prefill = _kernels(eager.step, 1, cuda)  # the whole prompt in one step
    prefill_wall = time.perf_counter() - t0
    while eager.has_unfinished():
        eager.step()
    batches = [_eager_batch(eager, a.context, n, a.steps, cuda) for n in a.batch]
    fused = eager.model.fused is not None
    del eager
    gc.collect()
    served = decode_engine(loaded, a.model, sp, a.context, max(a.batch), a.device, backend, steps=a.steps,
                           warmup=WARMUP)
    for b in batches:
        step = decode_step_s(served, a.context, b["batch"], steps=a.steps, warmup=WARMUP) * 1e3
        b.update(step_ms=round(step, 3), host_gap_ms=round(step - b["kernel_ms"], 3),
                 eager_host_gap_ms=round(b["eager_step_ms"] - b["kernel_ms"], 3))
    report = {**header(), "model": a.model, "config": a.config, "context": a.context, "steps": a.steps,
              "device_kind": a.device, "fused_ops": fused,
              "prefill_gpu_ms": round(sum(r["us_per_step"] for r in prefill) / 1e3, 2),
              "prefill_wall_s": round(prefill_wall, 3),  # under the profiler
              "decode_gpu_us_per_step": round(batches[0]["kernel_ms"] * 1e3, 1),  # the first --batch
              "prefill": prefill, "decode": batches[0]["kernels"], "batches": batches}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    tag = "" if a.batch == [1] else "_b" + "-".join(str(n) for n in a.batch)
    path = Path(a.out) / f"profile_{a.config}_{a.context}{tag}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"{a.config} @ {a.context} prefill: {report['prefill_gpu_ms']:.1f} ms of kernels ({path.name}; "
          f"wall {prefill_wall:.2f} s under the profiler)")
    _table(prefill, "ms", 1e-3)
    for b in batches:
        print(f"{a.config} @ {a.context} decode, batch {b['batch']}: kernels {b['kernel_ms']:.3f} ms/step; served step "
              f"(graphs) {b['step_ms']:.3f} ms, host gap {b['host_gap_ms']:.3f} ms; eager step "
              f"{b['eager_step_ms']:.3f} ms, host gap {b['eager_host_gap_ms']:.3f} ms")
        _table(b["kernels"], "us", 1.0)
    return 0


def _eager_batch(eng, context: int, n: int, steps: int, cuda: bool) -> dict:
    """Kernels of ``steps`` eager decode steps of ``n`` sequences, then the same steps' wall time
    without the profiler; the sequences are then run to the end."""
    start_batch(eng, context, n, output_tokens(n, 2 * steps, WARMUP))
    for _ in range(WARMUP):
        eng.step()
    before = eng.stats()
    kernels = _kernels(lambda: [eng.step() for _ in range(steps)], steps, cuda)
    walls = timed_steps(eng, steps)
    after = eng.stats()
    kinds = {k: v - before.step_kinds.get(k, 0) for k, v in after.step_kinds.items() if v - before.step_kinds.get(k, 0)}
    if kinds != {"decode_eager": 2 * steps} or after.running != n:
        raise RuntimeError(f"batch {n}: the profiled steps were {kinds} with {after.running} running, "
                           f"not {2 * steps} eager decode steps of the batch")
    while eng.has_unfinished():
        eng.step()
    return {"batch": n, "kernel_ms": round(sum(r["us_per_step"] for r in kernels) / 1e3, 4),
            "eager_step_ms": round(statistics.median(walls) * 1e3, 3), "kernels": kernels}


def _kernels(fn, steps: int, cuda: bool) -> list[dict]:
    """GPU kernels and copies run by ``fn()`` (``steps`` engine steps), by GPU time per step (on a
    CPU: torch ops by self CPU time)."""
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if cuda:
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        else:
            t = e.self_cpu_time_total
        if t > 0 and e.count:
            rows.append({"kernel": e.key[:120], "calls_per_step": e.count / steps, "us_per_step": t / steps})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def _table(rows: list[dict], unit: str, scale: float) -> None:
    for r in rows[:22]:
        print(f"{r['us_per_step'] * scale:11.2f} {unit} {r['calls_per_step']:7.1f}x  {r['kernel']}")


if __name__ == "__main__":
    raise SystemExit(main())
