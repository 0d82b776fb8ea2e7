"""Host time of an engine decode step by part, and the per-token host cost of the stream path.

With async decode a step's wall time is max(device time, host time), so the host side of a large
batch can set the served inter-token latency. This bench measures it on the CPU (torch backend,
the default model, the ``lserve serve`` sparsity defaults), ``python -m lserve.bench.host_step``:

* ``engine``: per batch size, a batch of sequences at ``--context`` tokens (one shared prompt
  prefix, reused through the prefix cache, so only the last page of each is prefilled) decodes
  ``--steps`` timed steps. ``host_ms`` is the step's wall time minus the model forward and the
  greedy argmax (the device's work on a GPU); a second pass times the parts: the scheduler
  (``schedule`` / ``reserve_next``), the attention backend's ``plan``, ``Sequence.append_token``
  (stop checks, detokenization) and ``Sequence.snapshot`` (the output object); ``other`` is the
  rest (the engine's per-step lists, input tensors, sampling bookkeeping). The cupy backend's
  host tables of the same plans (``CupyPlanner.plan`` of a CUDA-graph step plus its ``pack``,
  numpy only) are timed beside them: a GPU step runs them on top of ``plan``.
* ``stream``: ``--streams`` requests through :class:`~lserve.serve.replica.EngineReplica`
  in this process (its engine thread, its asyncio consumer), as a Ray replica runs them: the
  CPU seconds of the asyncio thread per streamed token (the replica's side of the path: the
  engine's hand-off, the event dict, metrics, and a pickle of each event as a stand-in for Ray's
  serialization) and of the engine thread per step. Both threads share the GIL, so the
  asyncio side's time per step adds to the engine's host time.

Writes ``<name>.json`` and ``<name>.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import shlex
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from lserve.attention.cupy_plan import CupyPlanner, PlanGeometry
from lserve.bench.report import header, write_json
from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams
from lserve.engine.sequence import Sequence
from lserve.models.loader import LoadedModel, load_model
from lserve.plotting import pyplot

DISTINCT = 16  # tokens at the end of each prompt that differ between sequences
PARTS = ("schedule", "plan", "append_token", "snapshot", "other")


class _Clock:
    """Seconds spent inside wrapped callables, by part name."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}

    def wrap(self, part: str, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.s[part] = self.s.get(part, 0.0) + time.perf_counter() - t0
        return timed

    def take(self) -> dict[str, float]:
        out, self.s = self.s, {}
        return out


@contextmanager
def _patched(obj, name: str, new):
    """``obj.name`` replaced by ``new`` for the duration (an instance or a class attribute)."""
    had = name in vars(obj)
    old = vars(obj)[name] if had else None
    setattr(obj, name, new)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def _engine(loaded: LoadedModel, context: int, batch: int, max_tokens: int) -> LLMEngine:
    per_seq = max_tokens + 2 * CacheConfig().page_size + DISTINCT
    cfg = EngineConfig(model="default", sparsity=SparsityConfig(pattern="auto"), max_num_seqs=batch,
                       max_batched_tokens=max(context, 256), max_model_len=context + max_tokens + 64,
                       cache=CacheConfig(dense_pool_tokens=context + batch * per_seq + 1024))
    return LLMEngine(cfg, loaded)


def _start(engine: LLMEngine, context: int, batch: int, max_tokens: int) -> None:
    """``batch`` greedy sequences of ``context`` prompt tokens (a shared prefix, then
    :data:`DISTINCT` tokens of their own), stepped until every one decodes."""
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size - 2
    shared = torch.randint(0, vocab, (context - DISTINCT,), generator=g).tolist()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(shared + torch.randint(0, vocab, (DISTINCT,), generator=g).tolist(), params)
        if i == 0:  # the prefix enters the cache before the others look it up
            while not any(o.token_ids for o in engine.step()):
                pass
    while engine.stats().waiting or any(not engine.sequence(r).in_decode for r in _running_ids(engine)):
        engine.step()


def _running_ids(engine: LLMEngine) -> list[str]:
    return [s.request_id for s in engine.scheduler.running]


def _decode_steps(engine: LLMEngine, steps: int, batch: int, clock: _Clock) -> list[dict]:
    """Per step: wall, forward and part seconds (``clock`` holds what the wrappers saw)."""
    rows = []
    before = engine.stats()
    for _ in range(steps):
        clock.take()
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        rows.append({"wall": wall, **clock.take()})
    after = engine.stats()
    eager = after.step_kinds.get("decode_eager", 0) - before.step_kinds.get("decode_eager", 0)
    if eager != steps or after.running != batch:
        raise RuntimeError(f"batch {batch}: {eager} of {steps} steps decoded the whole batch ({after.running} running)")
    return rows


def _ms(values: list[float]) -> dict:
    return {"median": round(statistics.median(values) * 1e3, 4), "mean": round(statistics.fmean(values) * 1e3, 4)}


def measure_engine(loaded: LoadedModel, context: int, batch: int, steps: int, warmup: int = 3) -> dict:
    """Host milliseconds per decode step of ``batch`` sequences at ``context`` tokens, by part."""
    engine = _engine(loaded, context, batch, max_tokens=2 * (steps + warmup) + 8)
    _start(engine, context, batch, 2 * (steps + warmup) + 8)
    for _ in range(warmup):
        engine.step()
    clock = _Clock()
    model = engine.model
    with _patched(model, "forward", clock.wrap("forward", model.forward)), \
            _patched(model, "greedy", clock.wrap("forward", model.greedy)):
        plain = _decode_steps(engine, steps, batch, clock)
        geometry = PlanGeometry.of(engine.backend, _gq(engine.model_config.group_size), True)
        tables = CupyPlanner(geometry)
        sched, backend = engine.scheduler, engine.backend
        plan_fn = clock.wrap("plan", backend.plan)

        def plan_and_tables(steps_, host=False):
            plan = plan_fn(steps_, host)
            t0 = time.perf_counter()
            st = tables.plan(plan, static=True)
            if st.bounds is not None:
                st.pack(units=False)
            clock.s["cupy_tables"] = clock.s.get("cupy_tables", 0.0) + time.perf_counter() - t0
            return plan

        with _patched(sched, "schedule", clock.wrap("schedule", sched.schedule)), \
                _patched(sched, "reserve_next", clock.wrap("schedule", sched.reserve_next)), \
                _patched(backend, "plan", plan_and_tables), \
                _patched(Sequence, "append_token", clock.wrap("append_token", Sequence.append_token)), \
                _patched(Sequence, "snapshot", clock.wrap("snapshot", Sequence.snapshot)):
            parts = _decode_steps(engine, steps, batch, clock)
    host = [r["wall"] - r.get("forward", 0.0) for r in plain]
    by_part = {}
    for p in PARTS[:-1]:
        by_part[p] = _ms([r.get(p, 0.0) for r in parts])
    part_host = [r["wall"] - r.get("forward", 0.0) - r.get("cupy_tables", 0.0) for r in parts]
    by_part["other"] = _ms([h - sum(r.get(p, 0.0) for p in PARTS[:-1]) for h, r in zip(part_host, parts)])
    return {"batch": batch, "context": context, "steps": steps, "host_ms": _ms(host),
            "forward_ms": _ms([r.get("forward", 0.0) for r in plain]),
            "host_ms_timed_parts": _ms(part_host), "parts_ms": by_part,
            "cupy_tables_ms": _ms([r.get("cupy_tables", 0.0) for r in parts])}


def _gq(group: int) -> int:
    """Query heads per decode CTA, as the cupy backend picks them (the largest divisor <= 8)."""
    return max(d for d in range(1, min(group, 8) + 1) if group % d == 0)


def measure_stream(streams: int, prompt_tokens: int, max_tokens: int) -> dict:
    """Per-token host cost of the engine -> replica stream path, ``streams`` requests at once."""
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="lserve-host-step-"))
    from lserve.serve.replica import EngineReplica

    replica = EngineReplica({"model": "default", "max_num_seqs": streams, "torch_threads": torch.get_num_threads()})
    tok = replica.engine.tokenizer
    prompts = [tok.decode(list(range(1000 + 7 * i, 1000 + 7 * i + prompt_tokens))) for i in range(streams)]
    engine_thread = next(t for t in threading.enumerate() if t.name == "lserve-engine")
    stats0 = replica.engine.stats()
    ser = [0.0]

    async def one(i: int) -> int:
        n = 0
        req = {"request_id": f"s{i}", "prompt": prompts[i],
               "params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
        async for ev in replica.generate(req):
            t0 = time.perf_counter()
            pickle.dumps(ev)
            ser[0] += time.perf_counter() - t0
            n += ev.get("num_tokens", 0)
        return n

    async def run() -> tuple[int, float, float, float | None]:
        eng0 = _thread_cpu(engine_thread)
        c0, w0 = time.thread_time(), time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(streams)))
        return sum(counts), time.thread_time() - c0, time.perf_counter() - w0, _thread_cpu(engine_thread) - eng0

    try:
        tokens, loop_cpu, wall, eng_cpu = asyncio.run(run())
    finally:
        replica.engine.shutdown()
    stats1 = replica.engine.stats()
    steps = stats1.steps - stats0.steps
    return {"streams": streams, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "tokens": tokens,
            "steps": steps, "wall_s": round(wall, 3),
            "loop_cpu_us_per_token": round(loop_cpu / tokens * 1e6, 2),
            "pickle_us_per_token": round(ser[0] / tokens * 1e6, 2),
            "loop_cpu_ms_per_step": round(loop_cpu / steps * 1e3, 4),
            "engine_thread_cpu_ms_per_step": None if eng_cpu is None else round(eng_cpu / steps * 1e3, 3)}


def _thread_cpu(thread: threading.Thread) -> float | None:
    """CPU seconds a thread of this process has used (Linux /proc), None elsewhere."""
    try:
        fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(out: str, name: str, batches: list[int], context: int, steps: int, streams: int,
        stream_tokens: int) -> dict:
    loaded = load_model("default")
    rows = []
    for b in batches:
        r = measure_engine(loaded, context, b, steps)
        rows.append(r)
        p = r["parts_ms"]
        print(f"batch {b:3d}: host {r['host_ms']['median']:.3f} ms/step (forward {r['forward_ms']['median']:.1f}); "
              + ", ".join(f"{k} {p[k]['median']:.3f}" for k in PARTS)
              + f"; cupy tables {r['cupy_tables_ms']['median']:.3f}", flush=True)
    stream = measure_stream(streams, 32, stream_tokens) if streams else None
    if stream:
        print(f"stream, {streams} requests: {stream['loop_cpu_us_per_token']} us of asyncio thread per token "
              f"({stream['loop_cpu_ms_per_step']} ms per step, pickle {stream['pickle_us_per_token']} us/token); "
              f"engine thread {stream['engine_thread_cpu_ms_per_step']} ms CPU per step", flush=True)
    report = {**header(), "model": loaded.source, "backend": "torch", "torch_threads": torch.get_num_threads(),
              "engine": "lserve serve sparsity defaults (learned pattern, budget 4096), async decode, fp32",
              "rows": rows, "stream": stream}
    Path(out).mkdir(parents=True, exist_ok=True)
    write_json(Path(out) / f"{name}.json", report)
    _plot(rows, Path(out) / f"{name}.png")
    return report


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.8))
    x = [str(r["batch"]) for r in rows]
    bottom = [0.0] * len(rows)
    for part in PARTS:
        v = [r["parts_ms"][part]["median"] for r in rows]
        ax.bar(x, v, bottom=bottom, label=part)
        bottom = [a + b for a, b in zip(bottom, v)]
    ax.plot(x, [r["cupy_tables_ms"]["median"] for r in rows], "kx--", label="cupy tables (GPU path, extra)")
    ax.set_xlabel("batch (decode sequences)")
    ax.set_ylabel("host ms per decode step (median)")
    ax.set_title(f"engine host time per decode step, {rows[0]['context']} context, CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lserve.bench.host_step", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--name", default="host_step_cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--streams", type=int, default=16, help="concurrent requests of the stream part (0: skip it)")
    ap.add_argument("--stream-tokens", type=int, default=24, help="output tokens of each stream-part request")
    a = ap.parse_args(argv)
    os.environ.setdefault("LSERVE_BENCH_COMMAND", shlex.join(["python", "-m", "lserve.bench.host_step",
                                                              *(sys.argv[1:] if argv is None else argv)]))
    if a.context <= DISTINCT or min(a.batches) < 1 or a.steps < 1:
        ap.error("--context must exceed 16 tokens, batches and --steps must be >= 1")
    run(a.out, a.name, a.batches, a.context, a.steps, a.streams, a.stream_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
