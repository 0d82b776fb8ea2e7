"""What a served step costs: decode-only (graph / eager), decode + prefill chunk, prefill-only chunks.

    python scripts/probes/probe_mixed.py OUT_DIR [--model llama3-8b] [--config lserve] [--batches 4 16]
        [--chunks 32 256 1024 2048 4096] [--long 32768]

Every step is timed synchronously (wall, device synchronised before and after) and the host's
share is the time ``LLMEngine._launch`` takes to return (everything is queued by then): a step
whose launch time is close to its wall time is bound by the host. The long-prompt part prefills
one ``--long`` prompt in chunks of each size, with flash and with cuDNN for the chunks' dense
past, against the whole prompt in one step (the engine's own TTFT). Writes
``probe_mixed_<config>.json``. A probe (it wraps a private method to time it), not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lserve.attention import chunked
from lserve.bench.e2e import CONFIGS
from lserve.bench.report import header
from lserve.config import CacheConfig, EngineConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams
from lserve.models.loader import load_model

BIG = 200_000


class Timed:
    """Wraps an engine's ``_launch`` to record how long the host takes to queue a step."""

    def __init__(self, eng: LLMEngine) -> None:
        self.eng, self.inner, self.last = eng, eng._launch, 0.0
        eng._launch = self

    def __call__(self, *a, **k):
        t = time.perf_counter()
        out = self.inner(*a, **k)
        self.last = time.perf_counter() - t
        return out


def step(eng: LLMEngine, timer: Timed) -> dict:
    torch.cuda.synchronize()
    timer.last = 0.0
    t = time.perf_counter()
    eng.step()
    torch.cuda.synchronize()
    info = eng.last_step_info
    return {"wall_ms": 1e3 * (time.perf_counter() - t), "launch_ms": 1e3 * timer.last, "graph": info.get("graph"),
            "decode": info.get("decode"), "prefill_tokens": info.get("prefill_tokens")}


def med(rows: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 3)


def summary(kind: str, rows: list[dict], **extra) -> dict:
    out = {"kind": kind, **extra, "wall_ms": med(rows, "wall_ms"), "launch_ms": med(rows, "launch_ms"),
           "graph": rows[-1]["graph"], "n": len(rows)}
    print(json.dumps(out), flush=True)
    return out


def rand_ids(n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab - 2, (n,)).tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--config", default="lserve", choices=list(CONFIGS))
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--chunks", type=int, nargs="+", default=[32, 256, 1024, 2048, 4096])
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--long-chunks", type=int, nargs="+", default=[4096, 8192])
    a = ap.parse_args()
    loaded = load_model(a.model, dtype=torch.bfloat16, device="cuda")
    V = loaded.config.vocab_size
    max_len = max(a.long, 5 * max(a.chunks) + 64) + 512
    eng = LLMEngine(EngineConfig(model=a.model, sparsity=CONFIGS[a.config], device="cuda", backend="cupy",
                                 cache=CacheConfig(dense_pool_tokens=64 * 4096 + 2 * max_len), max_num_seqs=40,
                                 max_batched_tokens=BIG, max_model_len=max_len), loaded)
    timer, budget, rows = Timed(eng), eng.scheduler.budget, []
    greedy = dict(temperature=0, ignore_eos=True)
    for b in a.batches:
        rids = [eng.add_request(rand_ids(2048, V), SamplingParams(max_tokens=4000, **greedy)) for _ in range(b)]
        budget.max_batched_tokens = BIG
        while not all(s.in_decode for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        for _ in range(4):
            eng.step()
        rows.append(summary("decode", [step(eng, timer) for _ in range(12)], batch=b))
        graphs, eng.graphs = eng.graphs, None
        rows.append(summary("decode_eager", [step(eng, timer) for _ in range(8)], batch=b))
        eng.graphs = graphs
        for n in a.chunks:
            budget.max_batched_tokens = b + n
            rid = eng.add_request(rand_ids(5 * n + 64, V), SamplingParams(max_tokens=1, **greedy))
            got = [step(eng, timer) for _ in range(5)]  # the first chunk starts at 0, the rest after a past
            rows.append(summary("mixed_first", got[:1], batch=b, chunk=n))
            rows.append(summary("mixed_cont", got[1:], batch=b, chunk=n, past=f"{n}-{4 * n}"))
            eng.abort(rid)
        if b == a.batches[0]:  # where the host time of a mixed step goes: a first chunk, then later ones
            budget.max_batched_tokens = b + 256
            rid = eng.add_request(rand_ids(4096, V), SamplingParams(max_tokens=1, **greedy))
            for part, n_steps in (("first", 1), ("cont", 3)):
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(n_steps):
                        eng.step()
                    torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                print(f"== profile of {n_steps} mixed step(s), {part} chunk(s) of 256, batch {b}", flush=True)
                print(table, flush=True)
                (Path(a.out) / f"probe_mixed_profile_{part}.txt").write_text(table)
            eng.abort(rid)
        for r in rids:
            eng.abort(r)
    # one long prompt: in one step, and in chunks with flash or cuDNN for the chunks' dense past
    ids = rand_ids(a.long, V)
    key = next(iter(chunked._IMPL), None)
    long_rows = []
    for n in [a.long] + a.long_chunks:
        for impl in (["flash", "cudnn"] if n < a.long else ["-"]):
            if key and impl != "-":
                chunked._IMPL[key] = impl
            for rep in range(2):  # the second run reuses whatever the first planned
                budget.max_batched_tokens = n
                eng.add_request(ids, SamplingParams(max_tokens=1, **greedy))
                torch.cuda.synchronize()
                t = time.perf_counter()
                got = []
                while eng.has_unfinished():
                    got.append(step(eng, timer))
                r = {"kind": "long", "context": a.long, "chunk": n, "impl": impl, "rep": rep,
                     "ttft_s": round(time.perf_counter() - t, 3), "steps": len(got),
                     "step_ms": [round(g["wall_ms"], 1) for g in got]}
                print(json.dumps(r), flush=True)
                long_rows.append(r)
    report = {**header(), "model": a.model, "config": a.config, "rows": rows, "long": long_rows}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"probe_mixed_{a.config}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
