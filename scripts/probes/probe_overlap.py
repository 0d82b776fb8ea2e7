"""Can decodes and prefills share the GPU at once? Two engines over one set of weights, on two streams.

    python scripts/probes/probe_overlap.py OUT_DIR [--model llama3-8b] [--batch 16] [--prompt 2048]
        [--long 32768 --long-chunk 4096] [--seconds 6]

Engine A decodes ``--batch`` sequences (CUDA graphs, async decode); engine B prefills fresh
``--prompt``-token prompts one step each, then one ``--long`` prompt in ``--long-chunk`` chunks.
Each runs in its own thread on its own CUDA stream: first alone, then both at once (A's stream
at high priority, then both at normal priority). A's step times are the inter-token latency its
requests would see; B's are prefill times. If both keep most of their speed together, a served
step need not wait for the other kind of work (decode is bound by memory bandwidth, prefill by
tensor-core throughput). Writes ``probe_overlap.json``. A probe, not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from lserve.bench.e2e import CONFIGS
from lserve.bench.report import header
from lserve.config import CacheConfig, EngineConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams
from lserve.models.loader import load_model

GREEDY = dict(temperature=0, ignore_eos=True)


def rand_ids(n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab - 2, (n,)).tolist()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else float("nan")


def stats(ms: list[float]) -> dict:
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2) if ms else None, "p90_ms": pct(ms, 0.9),
            "p99_ms": pct(ms, 0.99), "max_ms": round(max(ms), 2) if ms else None}


class Decoder:
    """Engine A: ``batch`` sequences in decode; each ``step()`` yields one token per sequence."""

    def __init__(self, eng: LLMEngine, batch: int, prompt: int, vocab: int) -> None:
        self.eng, self.batch = eng, batch
        for _ in range(batch):
            eng.add_request(rand_ids(prompt, vocab), SamplingParams(max_tokens=eng.max_model_len - prompt, **GREEDY))
        while eng.scheduler.waiting or not all(s.in_decode for s in eng.scheduler.running):
            eng.step()
        for _ in range(20):  # graphs captured, kernels compiled
            eng.step()
        torch.cuda.synchronize()

    def run(self, stop: threading.Event, stream: torch.cuda.Stream, out: list[float]) -> None:
        with torch.cuda.stream(stream):
            t = time.perf_counter()
            while not stop.is_set():
                self.eng.step()
                now = time.perf_counter()
                out.append(1e3 * (now - t))
                t = now


class Prefiller:
    """Engine B: fresh prompts of ``prompt`` tokens (one step each), or one long prompt in chunks."""

    def __init__(self, eng: LLMEngine, vocab: int) -> None:
        self.eng, self.vocab = eng, vocab

    def one(self, n: int, chunk: int) -> list[float]:
        """Prefill one ``n``-token prompt in ``chunk``-token steps; milliseconds of each step."""
        eng = self.eng
        eng.scheduler.budget.max_batched_tokens = chunk
        eng.add_request(rand_ids(n, self.vocab), SamplingParams(max_tokens=1, **GREEDY))
        got = []
        while eng.has_unfinished():
            t = time.perf_counter()
            eng.step()
            torch.cuda.current_stream().synchronize()
            got.append(1e3 * (time.perf_counter() - t))
        return got

    def run(self, stop: threading.Event, stream: torch.cuda.Stream, out: list[float], done: list[int], n: int,
            chunk: int, times: int = 0) -> None:
        with torch.cuda.stream(stream):
            while not stop.is_set() and (not times or len(done) < times):
                out.extend(self.one(n, chunk))
                done.append(n)


def scenario(name: str, dec: Decoder | None, pre: Prefiller | None, seconds: float, prio: bool,
             n: int, chunk: int, times: int = 0) -> dict:
    hi = torch.cuda.Stream(priority=-1 if prio else 0)
    lo = torch.cuda.Stream(priority=0)
    stop, a_ms, b_ms, done, threads = threading.Event(), [], [], [], []
    if dec is not None:
        threads.append(threading.Thread(target=dec.run, args=(stop, hi, a_ms)))
    if pre is not None:
        threads.append(threading.Thread(target=pre.run, args=(stop, lo, b_ms, done, n, chunk, times)))
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    if times and pre is not None:
        threads[-1].join()
    else:
        time.sleep(seconds)
    stop.set()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    row = {"scenario": name, "priority": prio, "wall_s": round(wall, 2), "prompt": n, "chunk": chunk}
    if dec is not None:
        row["decode_step"] = stats(a_ms[2:])
        row["decode_tok_s"] = round(len(a_ms) * dec.batch / wall, 1)
    if pre is not None:
        row["prefill_step"] = stats(b_ms)
        row["prefill_tok_s"] = round(sum(done) / wall, 1)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--config", default="lserve", choices=list(CONFIGS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--long-chunk", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=6.0)
    a = ap.parse_args()
    sys.setswitchinterval(0.0005)  # the decode thread's host work is short: let it in quickly
    loaded = load_model(a.model, dtype=torch.bfloat16, device="cuda")
    vocab = loaded.config.vocab_size
    sp = CONFIGS[a.config]
    eng_a = LLMEngine(EngineConfig(model=a.model, sparsity=sp, device="cuda", backend="cupy",
                                   cache=CacheConfig(dense_pool_tokens=a.batch * 16384), max_num_seqs=a.batch,
                                   max_model_len=16384), loaded)
    eng_b = LLMEngine(EngineConfig(model=a.model, sparsity=sp, device="cuda", backend="cupy", cuda_graphs=False,
                                   cache=CacheConfig(dense_pool_tokens=2 * a.long + 4096), max_num_seqs=2,
                                   max_model_len=a.long + 1024, max_batched_tokens=a.long), loaded)
    dec, pre = Decoder(eng_a, a.batch, a.prompt, vocab), Prefiller(eng_b, vocab)
    for _ in range(2):  # compile B's kernels and flash shapes
        pre.one(a.prompt, a.prompt)
    pre.one(a.long, a.long_chunk)
    rows = [scenario("decode alone", dec, None, a.seconds, True, 0, 0),
            scenario("prefill alone", None, pre, a.seconds, True, a.prompt, a.prompt),
            scenario("both, decode stream high priority", dec, pre, a.seconds, True, a.prompt, a.prompt),
            scenario("both, same priority", dec, pre, a.seconds, False, a.prompt, a.prompt),
            scenario("long prefill alone", None, pre, 0, True, a.long, a.long_chunk, times=1),
            scenario("both, long prefill, decode high priority", dec, pre, 0, True, a.long, a.long_chunk, times=1)]
    report = {**header(), "model": a.model, "config": a.config, "batch": a.batch, "rows": rows,
              "command": "python " + " ".join(sys.argv)}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "probe_overlap.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
