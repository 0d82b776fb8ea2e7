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
* ``emulated`` (``--device-ms``, 0: off): the model's device work replaced by a device queue that
  takes ``--device-ms`` per step and constant tokens (every host path stays real; reading the tokens
  waits with the GIL released, as ``cudaEventSynchronize`` does), so a step takes max(device,
  host) as on a GPU: the engine alone per batch, the in-process replica stream, and (unless
  ``--no-ray``) the same replica as a Ray Serve deployment streamed through a deployment handle,
  with the replica process's CPU per step. The ITL then says what the host side adds to the
  device step. ``--stream-interval 1 2 4`` runs the Ray part at each ``lserve serve
  --stream-interval`` (tokens per streamed event; ``--ray-streams``, ``--repeats``, ``--ray-only``
  pick its points).

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

import lserve.engine.llm_engine as llm_engine_module
from lserve.attention.cupy_plan import CupyPlanner, PlanGeometry, decode_query_heads
from lserve.bench.report import header, write_json
from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine.async_decode import HostTokens
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
        geometry = PlanGeometry.of(engine.backend, decode_query_heads(engine.model_config.group_size), True)
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


class _Device:
    """A device queue that runs each launched step for ``step_s`` seconds, one after the other."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.busy_until = step_s, 0.0

    def launch(self) -> float:
        """Queue one step; returns when its tokens are ready (perf_counter seconds)."""
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.step_s
        return self.busy_until


def _emulated_tokens(device: _Device):
    class EmulatedTokens(HostTokens):
        """Tokens ready when the emulated device finishes their step; reading them waits as
        ``cudaEventSynchronize`` does, with the GIL released (a sleep)."""

        def start(self, tokens):
            return tokens, device.launch()

        def read(self, fetch):
            tokens, ready = fetch
            wait = ready - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            return tokens.tolist()

    return EmulatedTokens


def _emulate_forward(engine: LLMEngine, token: int) -> None:
    """The model's forward and argmax replaced by constant outputs (the device's work is
    :class:`_Device`'s); every host path of the step stays real."""
    vocab, cache = engine.model_config.vocab_size, {}

    def forward(input_ids, positions, plan, backend, logits_index, *a, **k):
        n = logits_index.numel()
        if n not in cache:
            cache[n] = torch.zeros(n, vocab)
        return cache[n]

    engine.model.forward = forward
    engine.model.greedy = lambda logits: torch.full((logits.shape[0],), token, dtype=torch.long)


def make_replica(max_num_seqs: int, device_ms: float = 0.0, stream_interval: int = 1,
                 stream_interval_ms: float = 0.0):
    """An :class:`~lserve.serve.replica.EngineReplica` of the default model on the CPU (requests
    of up to 2048 tokens, ``stream_interval`` tokens and ``stream_interval_ms`` per streamed event); with
    ``device_ms`` > 0 its device work is emulated (:class:`_Device`, constant tokens)."""
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="lserve-host-step-"))
    from lserve.serve.replica import EngineReplica

    # a KV pool for short requests (the serve default's takes most of a minute to zero on a small machine)
    settings = {"model": "default", "max_num_seqs": max_num_seqs, "torch_threads": torch.get_num_threads(),
                "max_model_len": 2048, "max_cache_tokens": max(16384, 1024 * max_num_seqs),
                "stream_interval": stream_interval, "stream_interval_ms": stream_interval_ms}
    if device_ms <= 0:
        return EngineReplica(settings)
    with _patched(llm_engine_module, "HostTokens", _emulated_tokens(_Device(device_ms / 1e3))):
        replica = EngineReplica(settings)
    _emulate_forward(replica.engine.engine, replica.engine.tokenizer.encode(" the", False)[0])
    return replica


def _prompts(tok, n: int, tokens: int) -> list[str]:
    return [tok.decode(list(range(1000 + 7 * i, 1000 + 7 * i + tokens))) for i in range(n)]


def _request(i: int, prompt: str, max_tokens: int) -> dict:
    return {"request_id": f"s{i}", "prompt": prompt,
            "params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}


class _ItlClock:
    """Per-token gaps between the events of one stream that carry tokens (an event's gap shared
    out over its tokens), and the gaps between those events themselves."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.event_gaps: list[float] = []
        self.events = 0

    def clear(self) -> None:
        self.gaps.clear()
        self.event_gaps.clear()
        self.events = 0

    def stream(self):
        last = None

        def see(ev: dict) -> int:
            nonlocal last
            now, k = time.perf_counter(), ev.get("num_tokens", 0)
            if k and last is not None:
                self.gaps.extend([(now - last) / k] * k)
                self.event_gaps.append(now - last)
            if k:
                last = now
                self.events += 1
            return k
        return see

    def summary(self) -> dict:
        q = statistics.quantiles(self.gaps, n=100)
        e = statistics.quantiles(self.event_gaps, n=100) if len(self.event_gaps) > 1 else None
        return {"itl_p50_ms": round(q[49] * 1e3, 3), "itl_p90_ms": round(q[89] * 1e3, 3),
                "event_gap_p50_ms": None if e is None else round(e[49] * 1e3, 3),
                "token_events": self.events}


def measure_ray(streams: int, prompt_tokens: int, max_tokens: int, device_ms: float,
                switch_s: float | None = None, stream_interval: int = 1, stream_interval_ms: float = 0.0,
                by_value: bool = True) -> dict:
    """ITL of ``streams`` requests streamed from an emulated-device replica through Ray Serve
    (a deployment handle in this driver, as the ingress calls the replica), against the emulated
    device step: what Ray's per-item streaming adds in the replica's process, with the replica
    sending events of ``stream_interval`` tokens at least ``stream_interval_ms`` apart (``lserve serve
    --stream-interval``, ``--stream-interval-ms``), the handle calling it by value (gRPC, as the
    ingress does by default) or by reference (``lserve serve --no-engine-calls-by-value``)."""
    import ray
    from ray import serve

    tmp = tempfile.mkdtemp(prefix="lshs-", dir="/tmp")
    metrics_dir = tempfile.mkdtemp(prefix="lserve-host-step-")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=tmp, logging_level="WARNING",
             namespace="lserve-host-step", runtime_env={"env_vars": {"PROMETHEUS_MULTIPROC_DIR": metrics_dir}})
    try:
        serve.start(http_options={"location": "NoServer"}, logging_config={"log_level": "WARNING"})
        dep = serve.deployment(EmulatedReplica, name="replica", max_ongoing_requests=4 * streams,
                               ray_actor_options={"num_cpus": 1})
        handle = serve.run(dep.bind(streams, device_ms, switch_s, stream_interval, stream_interval_ms), name="host-step",
                           route_prefix=None)
        from lserve.models.loader import load_model as _load

        prompts = _prompts(_load("default").tokenizer, streams, prompt_tokens)
        itl = _ItlClock()

        async def one(i: int) -> int:
            see, n = itl.stream(), 0
            gen = handle.options(stream=True, method_name="generate",
                                 _by_reference=not by_value).remote(_request(i, prompts[i], max_tokens))
            async for ev in gen:
                n += see(ev)
            return n

        async def run() -> tuple[int, float]:
            w0 = time.perf_counter()
            counts = await asyncio.gather(*(one(i) for i in range(streams)))
            return sum(counts), time.perf_counter() - w0

        asyncio.run(run())  # warm-up: the handle's router, the replica's first steps
        itl.clear()
        cpu0 = handle.options(method_name="cpu").remote().result()
        steps0 = handle.options(method_name="engine_stats").remote().result()["steps"]
        tokens, wall = asyncio.run(run())
        cpu1 = handle.options(method_name="cpu").remote().result()
        steps = handle.options(method_name="engine_stats").remote().result()["steps"] - steps0
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"streams": streams, "stream_interval": stream_interval, "stream_interval_ms": stream_interval_ms,
            "by_value": by_value,
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens, "device_ms": device_ms, "replica_switch_interval_s": switch_s, "tokens": tokens,
            "wall_s": round(wall, 3), "steps": steps,
            "step_ms": round(wall / steps * 1e3, 3),
            "replica_cpu_ms_per_step": round((cpu1[0] - cpu0[0]) / steps * 1e3, 3),
            "engine_thread_cpu_ms_per_step": None if cpu0[1] is None else round((cpu1[1] - cpu0[1]) / steps * 1e3, 3),
            **itl.summary()}


class EmulatedReplica:
    """A Ray Serve deployment around :func:`make_replica` with the device emulated."""

    def __init__(self, max_num_seqs: int, device_ms: float, switch_s: float | None = None,
                 stream_interval: int = 1, stream_interval_ms: float = 0.0) -> None:
        if switch_s is not None:
            sys.setswitchinterval(switch_s)
        self.replica = make_replica(max_num_seqs, device_ms, stream_interval, stream_interval_ms)

    async def generate(self, request: dict):
        async for ev in self.replica.generate(request):
            yield ev

    def engine_stats(self) -> dict:
        return self.replica.engine_stats()

    def cpu(self) -> tuple[float, float | None]:
        """CPU seconds of this replica's process and of its engine thread so far."""
        eng = next(t for t in threading.enumerate() if t.name == "lserve-engine")
        return time.process_time(), _thread_cpu(eng)


def measure_stream(streams: int, prompt_tokens: int, max_tokens: int, device_ms: float = 0.0,
                   switch_s: float | None = None) -> dict:
    """Per-token host cost of the engine -> replica stream path, ``streams`` requests at once.

    ``device_ms`` > 0: the model's device work is emulated (:class:`_Device`, constant tokens),
    so the step's wall time is max(device, host) as on a GPU and the consumers' ITL shows what
    the host side adds; ``switch_s``: the interpreter's GIL switch interval during the run.
    """
    replica = make_replica(streams, device_ms)
    prompts = _prompts(replica.engine.tokenizer, streams, prompt_tokens)
    engine_thread = next(t for t in threading.enumerate() if t.name == "lserve-engine")
    stats0 = replica.engine.stats()
    ser, itl = [0.0], _ItlClock()

    async def one(i: int) -> int:
        see, n = itl.stream(), 0
        async for ev in replica.generate(_request(i, prompts[i], max_tokens)):
            n += see(ev)
            t0 = time.perf_counter()
            pickle.dumps(ev)
            ser[0] += time.perf_counter() - t0
        return n

    async def run() -> tuple[int, float, float, float | None]:
        eng0 = _thread_cpu(engine_thread)
        c0, w0 = time.thread_time(), time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(streams)))
        return sum(counts), time.thread_time() - c0, time.perf_counter() - w0, _thread_cpu(engine_thread) - eng0

    old_switch = sys.getswitchinterval()
    if switch_s is not None:
        sys.setswitchinterval(switch_s)
    try:
        tokens, loop_cpu, wall, eng_cpu = asyncio.run(run())
    finally:
        sys.setswitchinterval(old_switch)
        replica.shutdown()
    stats1 = replica.engine.stats()
    steps = stats1.steps - stats0.steps
    out = {"streams": streams, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "tokens": tokens,
           "steps": steps, "wall_s": round(wall, 3),
           "loop_cpu_us_per_token": round(loop_cpu / tokens * 1e6, 2),
           "pickle_us_per_token": round(ser[0] / tokens * 1e6, 2),
           "loop_cpu_ms_per_step": round(loop_cpu / steps * 1e3, 4),
           "engine_thread_cpu_ms_per_step": None if eng_cpu is None else round(eng_cpu / steps * 1e3, 3)}
    if device_ms > 0:
        out.update(device_ms=device_ms, switch_interval_s=sys.getswitchinterval() if switch_s is None else switch_s,
                   **itl.summary())
    return out


def emulated_engine_step_ms(loaded: LoadedModel, batch: int, device_ms: float, steps: int = 64) -> float:
    """Median wall ms of a decode step of ``batch`` sequences on the engine alone (no replica, no
    stream) with the device emulated as in :func:`measure_stream`: max(device, host)."""
    device = _Device(device_ms / 1e3)
    with _patched(llm_engine_module, "HostTokens", _emulated_tokens(device)):
        engine = _engine(loaded, 64, batch, max_tokens=steps + 16)
    _emulate_forward(engine, loaded.tokenizer.encode(" the", False)[0])
    _start(engine, 64, batch, steps + 16)
    for _ in range(4):
        engine.step()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    return round(statistics.median(walls) * 1e3, 3)


def _thread_cpu(thread: threading.Thread) -> float | None:
    """CPU seconds a thread of this process has used (Linux /proc), None elsewhere."""
    try:
        fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(out: str, name: str, batches: list[int], context: int, steps: int, streams: int,
        stream_tokens: int, device_ms: float = 0.0, ray: bool = False, emulated_tokens: int = 128,
        stream_intervals: tuple[int, ...] = (1,), repeats: int = 1, ray_only: bool = False,
        ray_streams: tuple[int, ...] = (), stream_intervals_ms: tuple[float, ...] = (0.0,),
        transports: tuple[bool, ...] = (True,)) -> dict:
    """Measure the parts the flags ask for (see the module docstring) and write ``<out>/<name>.json``.

    ``stream_intervals``, ``stream_intervals_ms``: the Ray part runs once per pair of values (the
    replica's ``--stream-interval``, ``--stream-interval-ms``) and stream count of ``ray_streams``
    (default: 1 and ``streams``), and per handle transport of ``transports`` (True: by value);
    ``repeats``: each Ray point runs that many times (rows in turn, so drift of a shared machine
    spreads over all); ``ray_only``: only the emulated Ray part (no engine rows, no in-process parts).
    """
    loaded = load_model("default")
    rows = []
    for b in [] if ray_only else batches:
        r = measure_engine(loaded, context, b, steps)
        rows.append(r)
        p = r["parts_ms"]
        print(f"batch {b:3d}: host {r['host_ms']['median']:.3f} ms/step (forward {r['forward_ms']['median']:.1f}); "
              + ", ".join(f"{k} {p[k]['median']:.3f}" for k in PARTS)
              + f"; cupy tables {r['cupy_tables_ms']['median']:.3f}", flush=True)
    stream = measure_stream(streams, 32, stream_tokens) if streams and not ray_only else None
    if stream:
        print(f"stream, {streams} requests: {stream['loop_cpu_us_per_token']} us of asyncio thread per token "
              f"({stream['loop_cpu_ms_per_step']} ms per step, pickle {stream['pickle_us_per_token']} us/token); "
              f"engine thread {stream['engine_thread_cpu_ms_per_step']} ms CPU per step", flush=True)
    emulated = None
    if device_ms > 0:
        counts = sorted({1, streams or 1})
        emulated = {"device_ms": device_ms,
                    "engine_step_ms": {} if ray_only else {str(b): emulated_engine_step_ms(loaded, b, device_ms)
                                                           for b in batches},
                    "in_process": [] if ray_only else [measure_stream(n, 32, emulated_tokens, device_ms)
                                                       for n in counts],
                    "ray": ([{**measure_ray(n, 32, emulated_tokens, device_ms, stream_interval=si,
                                            stream_interval_ms=ms, by_value=bv), "repeat": i}
                             for i in range(repeats) for n in (ray_streams or counts) for si in stream_intervals
                             for ms in stream_intervals_ms for bv in transports]
                            if ray else None)}
        print(f"emulated device {device_ms} ms: engine step ms by batch {emulated['engine_step_ms']}", flush=True)
        for kind in ("in_process", "ray"):
            for r in emulated[kind] or []:
                print(f"  {kind}, {r['streams']} streams: ITL p50 {r['itl_p50_ms']} / p90 {r['itl_p90_ms']} ms"
                      + (f", {'by value' if r['by_value'] else 'by reference'}, stream interval "
                         f"{r['stream_interval']} / {r['stream_interval_ms']} ms: step "
                         f"{r['step_ms']} ms, replica CPU "
                         f"{r['replica_cpu_ms_per_step']} ms/step (engine thread {r['engine_thread_cpu_ms_per_step']}), "
                         f"{r['token_events']} events" if kind == "ray" else ""), flush=True)
    report = {**header(), "model": loaded.source, "backend": "torch", "torch_threads": torch.get_num_threads(),
              "engine": "lserve serve sparsity defaults (learned pattern, budget 4096), async decode, fp32",
              "rows": rows, "stream": stream, "emulated": emulated}
    Path(out).mkdir(parents=True, exist_ok=True)
    write_json(Path(out) / f"{name}.json", report)
    _plot(rows, Path(out) / f"{name}.png")
    return report


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None or not rows:
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
    ap.add_argument("--device-ms", type=float, default=5.66,
                    help="the emulated device step of the emulated parts (0: skip them; 5.66: a batch-16 2k step "
                         "of Llama-3-8B on the H200, profile_lserve_2048_b1-16.json)")
    ap.add_argument("--emulated-tokens", type=int, default=128, help="output tokens of each emulated-part request")
    ap.add_argument("--no-ray", action="store_true", help="skip the emulated part through Ray Serve")
    ap.add_argument("--stream-interval", type=int, nargs="+", default=[1],
                    help="the Ray part once per value: tokens per streamed event (lserve serve --stream-interval)")
    ap.add_argument("--stream-interval-ms", type=float, nargs="+", default=[0.0],
                    help="and once per value: least ms between events (lserve serve --stream-interval-ms)")
    ap.add_argument("--ray-streams", type=int, nargs="+", default=[],
                    help="stream counts of the Ray part (default: 1 and --streams)")
    ap.add_argument("--repeats", type=int, default=1, help="times each Ray point is measured")
    ap.add_argument("--transports", nargs="+", choices=("value", "reference"), default=["value"],
                    help="the Ray part once per handle transport (lserve serve --[no-]engine-calls-by-value)")
    ap.add_argument("--ray-only", action="store_true",
                    help="only the emulated part through Ray Serve (no engine rows, no in-process parts)")
    a = ap.parse_args(argv)
    os.environ.setdefault("LSERVE_BENCH_COMMAND", shlex.join(["python", "-m", "lserve.bench.host_step",
                                                              *(sys.argv[1:] if argv is None else argv)]))
    if a.context <= DISTINCT or min(a.batches) < 1 or a.steps < 1:
        ap.error("--context must exceed 16 tokens, batches and --steps must be >= 1")
    if a.device_ms < 0 or a.emulated_tokens < 2:
        ap.error("--device-ms must be >= 0 and --emulated-tokens >= 2")
    if min(a.stream_interval) < 1 or a.repeats < 1 or min(a.ray_streams, default=1) < 1:
        ap.error("--stream-interval values, --ray-streams values and --repeats must be >= 1")
    if min(a.stream_interval_ms) < 0:
        ap.error("--stream-interval-ms values must be >= 0")
    if a.ray_only and (a.no_ray or a.device_ms <= 0):
        ap.error("--ray-only needs the Ray part: a --device-ms > 0 and no --no-ray")
    run(a.out, a.name, a.batches, a.context, a.steps, a.streams, a.stream_tokens, a.device_ms, not a.no_ray,
        a.emulated_tokens, tuple(a.stream_interval), a.repeats, a.ray_only, tuple(a.ray_streams),
        tuple(a.stream_interval_ms), tuple(t == "value" for t in a.transports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
