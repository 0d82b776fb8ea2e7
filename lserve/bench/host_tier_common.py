"""What both host-tier bench modes share: their settings, the model and sizes they measure, and
the engines they build (:mod:`lserve.bench.host_tier`, :mod:`lserve.bench.host_tier_concurrency`)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lserve.bench.host_tier_sizes import KVSizes, kv_sizes
from lserve.bench.host_tier_time import TimeModel
from lserve.config import KV_QUANT_CHOICES, CacheConfig, EngineConfig, available_host_bytes, require
from lserve.sparsity.prefill_blocks import estimate_share

CONTEXTS = (131072, 524288, 1048576)
DECODE_STEPS = 32
WARMUP_STEPS = 8
"""Decode steps a timed figure leaves out first: a new batch runs its first steps eagerly and captures
its CUDA graphs (one per key: selecting and reusing steps; up to 3.9 s at 1M)."""
ADMISSIONS = ("repeat", "all")  # the tier's admission of missed picks (lserve.cache.tier_policy.ADMIT_ON_REPEAT)
HOST_SHARE = 0.8  # of the host's available memory the tier may take by default


@dataclass
class Settings:
    """The bench's command line (``python -m lserve.bench.host_tier --help``), checked once.

    ``prefill_sparsity``: -1 the engine's "auto", else a tau in [0, 1] for both modes.
    ``gpu_kv_gib``: device memory for KV (0: free memory less ``reserve_gib``; needed on a CPU).
    ``host_kv_gib``: the host memory the tier may use (0: ``HOST_SHARE`` of what is available).
    """

    contexts: tuple[int, ...] = CONTEXTS
    resident_tokens: int = 65536
    deadline_s: float = 500.0
    prefill_sparsity: float = -1.0
    max_batched_tokens: int = 8192
    kv_quant: str = "int4"
    gpu_kv_gib: float = 0.0
    host_kv_gib: float = 0.0
    reserve_gib: float = 8.0
    decode_steps: int = DECODE_STEPS
    concurrency: bool = False
    capacity: bool = False
    model: str = "llama3-8b"
    device: str = "cuda"
    modes: tuple[str, ...] = ("tier", "gpu")
    name: str = "host_tier_h200"
    admission: str = "repeat"
    profile_steps: int = 0
    host_profile_steps: int = 0

    def __post_init__(self) -> None:
        require(bool(self.contexts) and all(c > 0 for c in self.contexts), f"contexts must be > 0, got {self.contexts}")
        require(self.resident_tokens > 0, f"--resident-tokens must be > 0, got {self.resident_tokens}")
        require(self.deadline_s > 0, f"--deadline must be > 0 seconds, got {self.deadline_s}")
        require(self.prefill_sparsity == -1.0 or 0.0 <= self.prefill_sparsity <= 1.0,
                f"--prefill-sparsity must be in [0, 1] or 'auto', got {self.prefill_sparsity}")
        require(self.max_batched_tokens >= 16, f"--max-batched-tokens must be >= 16, got {self.max_batched_tokens}")
        require(self.kv_quant in KV_QUANT_CHOICES, f"--kv-quant must be one of {KV_QUANT_CHOICES}, got {self.kv_quant!r}")
        require(self.gpu_kv_gib >= 0 and self.host_kv_gib >= 0 and self.reserve_gib >= 0,
                "--gpu-kv-gib, --host-kv-gib and the reserve must be >= 0")
        require(self.decode_steps >= 2, f"--decode-steps must be >= 2, got {self.decode_steps}")
        require(bool(self.modes) and set(self.modes) <= {"tier", "gpu"},
                f"--modes must name tier and/or gpu, got {','.join(self.modes)}")
        require(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", self.name)), f"--name must be a file stem, got {self.name!r}")
        require(self.admission in ADMISSIONS, f"--admission must be one of {ADMISSIONS}, got {self.admission!r}")
        require(self.profile_steps >= 0, f"--profile-steps must be >= 0, got {self.profile_steps}")
        require(self.host_profile_steps >= 0, f"--host-profile-steps must be >= 0, got {self.host_profile_steps}")
        require(self.profile_steps == 0 or self.device.startswith("cuda"),
                "--profile-steps traces the GPU: it needs --device cuda")
        require(not (self.concurrency and self.capacity), "--concurrency and --capacity are separate runs: give one")
        require(self.device.startswith("cuda") or self.gpu_kv_gib > 0,
                "--gpu-kv-gib is needed off a GPU (the KV memory of the device being modelled)")

    @property
    def backend(self) -> str:
        return "cupy" if self.device.startswith("cuda") else "torch"


@dataclass
class Setup:
    """The model under test and what the runs are sized from."""

    settings: Settings
    loaded: object  # None: each engine loads its own (make_engine)
    sparsity: object  # SparsityConfig as given (its prefill tau unresolved)
    prefill_tau: float  # resolved by the engine's rule (0: off; -1: per-layer calibrated taus)
    prefill_min_len: int
    sizes: KVSizes
    gpu_bytes: float
    host_bytes: float
    time: TimeModel

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.settings.device.startswith("cuda") else torch.float32

    def header(self) -> dict:
        s = self.settings
        return {"model": s.model, "kv_quant": s.kv_quant, "sparsity": "lserve", "admission": s.admission,
                "decode_steps": s.decode_steps,
                "prefill_sparsity": self.prefill_tau, "prefill_sparsity_min_len": self.prefill_min_len,
                "max_batched_tokens": s.max_batched_tokens, "kv_bytes_per_token": self.sizes.device_per_token,
                "host_kv_bytes_per_token": self.sizes.host_per_token, "host_bytes_available": self.host_bytes,
                "gpu_bytes_for_kv": self.gpu_bytes, "max_context_gpu": int(self.gpu_bytes // self.sizes.device_per_token)}


def setup(s: Settings, keep_weights: bool = True) -> Setup:
    """Load the model, resolve the prefill tau as the engine will, and size the device and host;
    set the tier's admission rule for the engines built after. ``keep_weights=False``: the engines
    load their own (``Setup.loaded`` None), so the device is sized with no weights loaded."""
    from lserve.cache import tier_policy

    tier_policy.ADMIT_ON_REPEAT = s.admission == "repeat"
    from lserve.bench.e2e import CONFIGS
    from lserve.engine.llm_engine import build_layout, resolve_prefill, step_alpha
    from lserve.models.loader import load_model

    dtype = torch.bfloat16 if s.device.startswith("cuda") else torch.float32
    loaded = load_model(s.model, dtype=dtype, device=s.device)
    mc = loaded.config
    sp = replace(CONFIGS["lserve"], prefill_sparsity=s.prefill_sparsity)
    resolved, _, _ = resolve_prefill(sp, s.device, mc, dtype)
    sizes = kv_sizes(s.model, mc, sp, s.kv_quant, dtype, s.backend)
    if not keep_weights:
        loaded = None
        free_memory()
    gpu = device_kv_bytes(s)
    host = s.host_kv_gib * 2**30 if s.host_kv_gib else available_host_bytes() * HOST_SHARE
    layout = build_layout(EngineConfig(model=s.model, sparsity=sp), mc)
    tm = TimeModel(step_alpha(mc, layout), sizes.host_per_token, s.max_batched_tokens,
                   estimate_share(sp.prefill_estimator, sp.prefill_stride))
    return Setup(s, loaded, sp, resolved.prefill_sparsity, resolved.prefill_sparsity_min_len, sizes, gpu, host, tm)


def device_kv_bytes(s: Settings) -> float:
    """Device memory the runs may give KV: ``--gpu-kv-gib``, else what is free now less the reserve."""
    if s.gpu_kv_gib:
        return s.gpu_kv_gib * 2**30
    return torch.cuda.mem_get_info()[0] - s.reserve_gib * 2**30


def make_engine(st: Setup, pool_tokens: int, host_kv_gib: float, max_num_seqs: int, max_len: int):
    """An engine of the bench's model and settings: a dense pool of ``pool_tokens`` tokens (the
    resident set with the tier), ``host_kv_gib`` of host pages, no prefix cache (every prompt's
    pages are its own). It shares ``st.loaded`` and adds its fused copies beside it; with
    ``st.loaded`` None it loads the model itself (the same seed, so the same weights) and holds
    only what its model uses, as a served replica does."""
    from lserve.engine.llm_engine import LLMEngine

    s = st.settings
    cache = CacheConfig(dense_pool_tokens=pool_tokens, kv_quant=s.kv_quant, host_kv_gib=host_kv_gib)
    cfg = EngineConfig(model=s.model, sparsity=st.sparsity, cache=cache, device=s.device, backend=s.backend,
                       max_num_seqs=max_num_seqs, max_batched_tokens=s.max_batched_tokens, max_model_len=max_len,
                       allow_long_max_model_len=True, prefix_cache=False)
    return LLMEngine(cfg, st.loaded)


def admits(eng, tokens: int) -> int:
    """Sequences of ``tokens`` tokens the engine's allocators hold at once (the scheduler admits
    and grows a sequence while both its dense pages and its ring are free)."""
    c = eng.cache
    n = min(eng.config.max_num_seqs, c.dense_alloc.num_pages // c.pages_for(tokens))
    return min(n, c.stream_alloc.num_pages // c.stream_pages_per_seq) if c.stream_pages_per_seq else n


PROBE_POOL = 65536  # dense pool tokens of the engine that measures the overhead


def top_allocations(snapshot: dict, top: int = 12) -> dict[str, int]:
    """Bytes of the live allocations in a ``torch.cuda.memory._snapshot()``, by the innermost
    ``lserve`` frame that made them (``file:line function``; "other" without one), largest first."""
    per: dict[str, int] = {}
    for seg in snapshot.get("segments", []):
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated":
                continue
            where = next((f"{f['filename'].rsplit('/lserve/', 1)[-1]}:{f['line']} {f['name']}"
                          for f in blk.get("frames", []) if "/lserve/" in f.get("filename", "")), "other")
            per[where] = per.get(where, 0) + int(blk["size"])
    return dict(sorted(per.items(), key=lambda kv: -kv[1])[:top])


def overhead_bytes(st, max_len: int) -> tuple[float, dict]:
    """Device bytes an engine of ``max_len`` tokens takes beyond its KV cache, its weights included
    (0 off a GPU): one is built with a small pool, loading its own weights, and the device's free
    memory read before and after (the checkpoint's tensors it fused, dropped, given back). Also where they
    went: torch's allocations (the largest by the lserve line that made them, from torch's memory
    history), what torch's allocator holds besides, CuPy's pool, and the rest (modules, library
    workspaces outside both allocators)."""
    if not torch.cuda.is_available() or not st.settings.device.startswith("cuda"):
        return 0.0, {}
    import cupy

    free_memory()
    before = torch.cuda.mem_get_info()[0]
    alloc0, res0, cp0 = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(),
                         cupy.get_default_memory_pool().total_bytes())
    try:  # a private torch API: without it the parts lack the largest allocations, nothing else
        torch.cuda.memory._record_memory_history(max_entries=200000)
        history = True
    except (AttributeError, RuntimeError, TypeError):
        history = False
    try:
        eng = make_engine(st, PROBE_POOL, 0.0, 1, max_len)
        torch.cuda.empty_cache()
        snap = torch.cuda.memory._snapshot() if history else {}
    finally:
        if history:
            torch.cuda.memory._record_memory_history(enabled=None)
    cache = sum(eng.cache.nbytes().values())
    used = before - torch.cuda.mem_get_info()[0] - cache
    gib = 2**30
    allocated = torch.cuda.memory_allocated() - alloc0 - cache
    reserved = torch.cuda.memory_reserved() - res0
    cupy_pool = cupy.get_default_memory_pool().total_bytes() - cp0
    parts = {"torch_allocated_gib": round(allocated / gib, 3),
             "torch_reserved_unused_gib": round((reserved - allocated - cache) / gib, 3),
             "cupy_pool_gib": round(cupy_pool / gib, 3),
             "rest_gib": round((used - reserved + cache - cupy_pool) / gib, 3),
             "largest_gib": {k: round(v / gib, 3) for k, v in top_allocations(snap).items()}}
    del eng
    free_memory()
    return float(max(used, 0)), parts


def free_memory() -> None:
    """Give a dropped engine's memory back before the next one is built (the caller drops it)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def host_kv_row(eng) -> dict:
    """The tier's counters for a row (empty with the tier off); checks its tables agree."""
    st = eng.stats().host_kv
    if st is None:
        return {}
    eng.cache.host_tier.check()
    return {"hit_rate": st.hit_rate, "h2d_bytes_total": st.bytes_h2d, "h2d_bytes_last_step": st.step_bytes_h2d,
            "d2h_bytes_total": st.bytes_d2h, "fetched": st.fetched, "deferred": st.deferred, "streamed": st.streamed,
            "spilled": st.spilled, "fetch_layers_skipped": st.fetch_layers_skipped,
            "prefill_streamed": st.prefill_streamed, "prefill_bytes_h2d": st.prefill_bytes_h2d,
            "h2d_copies": st.h2d_copies, "virtual_tokens": eng.cache.dense_alloc.num_pages * eng.cache.page_size}


def profile_host(eng, n: int, top: int = 25) -> dict:
    """``n`` decode steps under cProfile: the host's own seconds a step by function (``tottime``)
    and, for the functions with the most time under them, ``cumtime``; where the host, not the GPU,
    sets a step's time, the functions of the tier's plan-time work show here."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(n):
        eng.step()
    pr.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(pr).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)

    def name(k):
        return f"{Path(k[0]).name}:{k[1]}:{k[2]}"

    def ranked(i):
        rows = sorted(stats.items(), key=lambda kv: -kv[1][i])[:top]
        return {name(k): round(v[i] / n * 1e3, 4) for k, v in rows}

    return {"host_profiled_steps": n, "host_profiled_wall_ms_per_step": round(wall / n * 1e3, 3),
            "host_tottime_ms_per_step": ranked(2), "host_cumtime_ms_per_step": ranked(3)}


def profile_decode(eng, n: int) -> dict:
    """``n`` decode steps under a CUDA trace: wall and GPU-busy ms a step (the difference is the
    GPU waiting for the host: the tier's plan-time work shows there) and GPU ms a step per kernel,
    to set against the all-GPU row's (the decode kernels' reads of host pages show there)."""
    from torch.profiler import ProfilerActivity, profile

    from lserve.bench.gpu_trace import busy_seconds, kernel_seconds

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        t0 = time.perf_counter()
        for _ in range(n):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = trace.events()
    return {"profiled_steps": n, "profiled_wall_ms_per_step": round(wall / n * 1e3, 3),
            "profiled_gpu_busy_ms_per_step": round(busy_seconds(events) / n * 1e3, 3),
            "profiled_kernel_ms_per_step": {k: round(v / n * 1e3, 4) for k, v in kernel_seconds(events, 15).items()}}
