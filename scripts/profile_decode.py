"""Where a decode step's GPU time goes: torch.profiler over eager decode steps of the engine.

    python scripts/profile_decode.py OUT_DIR [--model llama3-8b] [--config lserve] [--context 32768]

Writes ``profile_decode_<config>_<context>.json`` (kernels by GPU time per step) and prints the
table. Eager steps (no CUDA graph) so every kernel is attributed; kernel durations are the same
as inside a graph, the launch gaps are not.
"""

from __future__ import annotations

import argparse
import json
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
    eng = LLMEngine(EngineConfig(model=a.model, sparsity=CONFIGS[a.config], cache=CacheConfig(max_tokens=n),
                                 device="cuda", backend="cupy", max_num_seqs=1, max_batched_tokens=a.context,
                                 max_model_len=n, cuda_graphs=False), loaded)
    ids = torch.randint(0, loaded.config.vocab_size - 2, (a.context,)).tolist()
    eng.add_request(ids, SamplingParams(max_tokens=4 * a.steps, temperature=0, ignore_eos=True))
    for _ in range(a.steps + 1):  # prefill + warm-up decodes
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            eng.step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.count:
            rows.append({"kernel": e.key[:120], "calls_per_step": e.count / a.steps, "us_per_step": t / a.steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    report = {**header(), "model": a.model, "config": a.config, "context": a.context, "steps": a.steps,
              "fused_ops": eng.model.fused is not None, "gpu_us_per_step": round(total, 1), "kernels": rows}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    path = Path(a.out) / f"profile_decode_{a.config}_{a.context}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"{a.config} @ {a.context}: {total:.0f} us of kernels per step ({path})")
    for r in rows[:25]:
        print(f"{r['us_per_step']:9.1f} us {r['calls_per_step']:6.1f}x  {r['kernel']}")


if __name__ == "__main__":
    main()
