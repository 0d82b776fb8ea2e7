"""Where GPU time goes: torch.profiler over the engine's prefill step and eager decode steps.

    python scripts/profile_steps.py OUT_DIR [--model llama3-8b] [--config lserve] [--context 32768]

Writes ``profile_<config>_<context>.json`` (kernels by GPU time, prefill and per decode step) and
prints the tables. Eager steps (no CUDA graph) so every kernel is attributed; kernel durations are the same
as inside a graph, the launch gaps are not.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lserve.bench.e2e import CONFIGS
from lserve.bench.report import header
from lserve.config import CacheConfig, EngineConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams
from lserve.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--config", default="lserve", choices=list(CONFIGS))
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    loaded = load_model(a.model, dtype=torch.bfloat16, device="cuda")
    n = a.context + 4 * a.steps + 64
    eng = LLMEngine(EngineConfig(model=a.model, sparsity=CONFIGS[a.config], cache=CacheConfig(dense_pool_tokens=n),
                                 device="cuda", backend="cupy", max_num_seqs=1, max_batched_tokens=a.context,
                                 max_model_len=n, cuda_graphs=False), loaded)
    ids = torch.randint(0, loaded.config.vocab_size - 2, (a.context,)).tolist()
    eng.add_request(ids, SamplingParams(max_tokens=4 * a.steps, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prefill = _kernels(lambda: eng.step(), 1)  # the whole prompt in one step
    prefill_wall = time.perf_counter() - t0
    for _ in range(a.steps):  # warm-up decodes
        eng.step()
    decode = _kernels(lambda: [eng.step() for _ in range(a.steps)], a.steps)
    report = {**header(), "model": a.model, "config": a.config, "context": a.context, "steps": a.steps,
              "fused_ops": eng.model.fused is not None,
              "prefill_gpu_ms": round(sum(r["us_per_step"] for r in prefill) / 1e3, 2),
              "prefill_wall_s": round(prefill_wall, 3),  # under the profiler
              "decode_gpu_us_per_step": round(sum(r["us_per_step"] for r in decode), 1),
              "prefill": prefill, "decode": decode}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    path = Path(a.out) / f"profile_{a.config}_{a.context}.json"
    path.write_text(json.dumps(report, indent=1))
    for what, rows, unit, scale in (("prefill", prefill, "ms", 1e-3), ("decode", decode, "us", 1.0)):
        total = sum(r["us_per_step"] for r in rows) * scale
        print(f"{a.config} @ {a.context} {what}: {total:.1f} {unit} of kernels per step ({path.name}; "
              f"prefill wall {prefill_wall:.2f} s)")
        for r in rows[:22]:
            print(f"{r['us_per_step'] * scale:11.2f} {unit} {r['calls_per_step']:7.1f}x  {r['kernel']}")


def _kernels(fn, steps: int) -> list[dict]:
    """GPU kernels and copies run by ``fn()`` (``steps`` engine steps), by GPU time per step."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.count:
            rows.append({"kernel": e.key[:120], "calls_per_step": e.count / steps, "us_per_step": t / steps})
    return sorted(rows, key=lambda r: -r["us_per_step"])


if __name__ == "__main__":
    main()
