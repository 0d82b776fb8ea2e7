"""K/V streaming probe: how fast one CTA streams 64-token K/V tiles from HBM into shared
memory on sm_90, cp.async (16 B per thread) against Hopper bulk copies (``cp.async.bulk`` with
an mbarrier per stage), for different ring depths, thread counts and page orders.

    python scripts/probes/probe_stream.py OUT_DIR [--iters 20] [--warmup 3]
    python scripts/probes/probe_stream.py --nvcc-check [--nvcc PATH]   (compile every variant, no GPU)

Pools: K and V, each [16384, 64, 128] bf16 (random normal, 256 MB each: a 256k-token cache).
CTA c streams T tiles; tile t is page ``idx[c * T + t]``: its K block and its V block (2 x 16 KB)
go into stage t % S of an S-stage ring (same scheme as ``ring_start`` / ``ring_next`` in
kernels/mma.cuh: S - 1 tiles in flight, a stage is refilled after a ``__syncthreads``). Each
landed tile is consumed for real (every thread adds four 16-byte words of K and of V, as floats,
into a register; one float per thread goes to a sink that is checked against torch). Copy modes:

  cpasync     16-byte ``cp.async.cg`` per thread into rows of pitch 272 B, one commit group per
              tile, ``cp.async.wait_group S-2`` + ``__syncthreads``.
  bulk_row    128 bulk copies of 256 B per tile (64 K rows, 64 V rows), one per thread, into
              rows of pitch 272 B, completing on the stage's mbarrier (thread 0 arrive.expect_tx
              32768 B); everybody waits with ``mbarrier.try_wait.parity``.
  bulk_block  2 bulk copies of 16 KB per tile (K block, V block) by thread 0 into an unpadded
              stage (pitch 256 B), same mbarrier protocol.

Page orders: ``seq`` (consecutive pages per CTA) and ``rand`` (a fixed random permutation).
Each timed launch reads a different window of the page order (no page is read twice in a
config until the pool wraps) and is preceded by a 256 MB read that flushes L2.

Configurations: idle GPU, long units (36 CTAs x 16 tiles: cpasync S 2/3/4/6 and 256 threads at
S 3, bulk_row and bulk_block S 3/6, both orders); one CTA alone (32 tiles, S 3, rand);
reuse-step-like (144 CTAs x 2 tiles, S 3, rand); saturated (2 CTAs per SM x 32 tiles, S 3,
seq). Per config: kernel time (median of CUDA events), and from ``%globaltimer`` stamps of the
last launch (thread 0: start, setup done, tile t landed for t < 32): median first-tile latency,
median interval between consecutive tiles (also from ``%clock64``, converted with a calibrated
SM clock), per-CTA GB/s = 32 KB / interval, aggregate GB/s; and the sink check (OK/MISMATCH).
Prints one line per config and writes OUT_DIR/probe_stream.json (exit status 1 on a mismatch).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

P, ROWS, D = 16384, 64, 128  # pool pages, tokens per page, head dim
TILE_BYTES = 2 * ROWS * D * 2  # K block + V block, bf16
N_SLOT = 34  # stamp columns: 0 start, 1 setup done (page list + mbarriers), 2 + t tile t landed
N_STAMPED = N_SLOT - 2
MAX_TILES = 256  # page-list capacity in shared memory
MODES = {"cpasync": 0, "bulk_row": 1, "bulk_block": 2}
PITCH = {"cpasync": 272, "bulk_row": 272, "bulk_block": 256}

SRC = r"""
// probe_stream: one CTA streams T K/V tiles through an S-stage shared-memory ring.
// PS_MODE 0 = cp.async 16 B, 1 = bulk copy per 256-B row, 2 = bulk copy per 16-KB block.
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef PS_MODE
#error "PS_MODE"
#endif
#ifndef PS_STAGES
#error "PS_STAGES"
#endif
#ifndef PS_THREADS
#error "PS_THREADS"
#endif
#ifndef PS_PROXY_FENCE
#define PS_PROXY_FENCE 1
#endif

#define PS_ROWS 64
#define PS_D 128
#define PS_ROW_BYTES (PS_D * 2)
#if PS_MODE == 2
#define PS_PITCH 256
#else
#define PS_PITCH 272
#endif
#define PS_HALF (PS_ROWS * PS_PITCH)             // K part of a stage; V follows
#define PS_STAGE_BYTES (2 * PS_HALF)
#define PS_TILE_BYTES (2 * PS_ROWS * PS_ROW_BYTES)
#define PS_WORDS_PER_HALF (PS_ROWS * PS_ROW_BYTES / 16)  // 1024 16-byte words
#define PS_NSLOT N_SLOT_
#define PS_NSTAMPED (PS_NSLOT - 2)
#define PS_MAX_TILES MAX_TILES_
#define PS_READ 4  // 16-byte words of K and of V each thread consumes per tile

static_assert(PS_WORDS_PER_HALF % PS_THREADS == 0, "threads must divide 1024");
static_assert(PS_STAGES >= 2, "at least two stages");

__device__ __forceinline__ u64 gtimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}
__device__ __forceinline__ u64 clk64() {
    u64 t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
    return t;
}
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

// ---- cp.async -------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// ---- mbarrier + bulk copy (sm_90) -----------------------------------------------------------
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Make the initialised barriers visible to the async proxy (the bulk copies' complete_tx).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// Arrive (count 1) and add ``bytes`` to the current phase's expected transaction count.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n\t}"
                 ::"r"(bar), "r"(bytes) : "memory");
}
// Spin until the phase with parity ``parity`` has completed (acquire, CTA scope).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}
// Generic-proxy accesses of shared memory before this fence are ordered before the async
// proxy's (bulk copies) after it: the stage being refilled was just read by the consumers.
__device__ __forceinline__ void fence_proxy_async() {
#if PS_PROXY_FENCE
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ float sum8(uint4 w) {
    float s = 0.f;
    const u32 a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        s += __uint_as_float(a[i] << 16);          // element 2i (low half)
        s += __uint_as_float(a[i] & 0xffff0000u);  // element 2i + 1
    }
    return s;
}

// K, V: [P, 64, 128] bf16 pools. idx: page of tile t of CTA c at idx[c * T + t].
// stamps: u64 [grid, 2, PS_NSLOT] (globaltimer row, clock64 row): 0 start, 1 setup done,
// 2 + t tile t landed (t < PS_NSTAMPED). sink: float [grid, PS_THREADS].
extern "C" __global__ void __launch_bounds__(PS_THREADS)
probe_stream(const u16* __restrict__ K, const u16* __restrict__ V, const int* __restrict__ idx, int T,
             u64* __restrict__ stamps, float* __restrict__ sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ int s_page[PS_MAX_TILES];
#if PS_MODE != 0
    __shared__ __align__(8) u64 s_bar[PS_STAGES];
#endif
    const int tid = threadIdx.x, c = blockIdx.x;
    u64* st_g = stamps + (u64)c * 2 * PS_NSLOT;
    u64* st_c = st_g + PS_NSLOT;
    if (tid == 0) { st_g[0] = gtimer(); st_c[0] = clk64(); }

    for (int i = tid; i < T; i += PS_THREADS) s_page[i] = idx[(u64)c * T + i];
#if PS_MODE != 0
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < PS_STAGES; ++s) mbar_init(smem_u32(&s_bar[s]), 1);
        mbar_init_fence();
    }
#endif
    __syncthreads();
    if (tid == 0) { st_g[1] = gtimer(); st_c[1] = clk64(); }

    const u32 sbase = smem_u32(smem);
    // Issue the copies of tile t into stage s.
    auto load = [&](int t, int s) {
        const u64 pg = (u64)s_page[t] * (PS_ROWS * PS_D);
        const u16* k = K + pg;
        const u16* v = V + pg;
        const u32 dst = sbase + (u32)(s * PS_STAGE_BYTES);
#if PS_MODE == 0
#pragma unroll
        for (int i = 0; i < PS_WORDS_PER_HALF / PS_THREADS; ++i) {
            const int w = tid + i * PS_THREADS, r = w >> 4, ch = w & 15;
            const u32 o = (u32)(r * PS_PITCH + ch * 16);
            cp_async16(dst + o, k + r * PS_D + ch * 8);
            cp_async16(dst + PS_HALF + o, v + r * PS_D + ch * 8);
        }
#elif PS_MODE == 1
        const u32 bar = smem_u32(&s_bar[s]);
        if (tid == 0) mbar_arrive_expect_tx(bar, PS_TILE_BYTES);
        for (int r = tid; r < 2 * PS_ROWS; r += PS_THREADS) {
            fence_proxy_async();
            const int h = r / PS_ROWS, rr = r % PS_ROWS;
            bulk_g2s(dst + (u32)(h * PS_HALF + rr * PS_PITCH), (h ? v : k) + rr * PS_D, PS_ROW_BYTES, bar);
        }
#else
        if (tid == 0) {
            const u32 bar = smem_u32(&s_bar[s]);
            fence_proxy_async();
            mbar_arrive_expect_tx(bar, PS_TILE_BYTES);
            bulk_g2s(dst, k, PS_ROWS * PS_ROW_BYTES, bar);
            bulk_g2s(dst + PS_HALF, v, PS_ROWS * PS_ROW_BYTES, bar);
        }
#endif
    };

#pragma unroll
    for (int st = 0; st < PS_STAGES - 1; ++st) {
        if (st < T) load(st, st);
#if PS_MODE == 0
        cp_async_commit();
#endif
    }
    float acc = 0.f;
    for (int t = 0; t < T; ++t) {
        const int s = t % PS_STAGES;
#if PS_MODE == 0
        cp_async_wait<PS_STAGES - 2>();  // this thread's copies of tile t are done
#else
        mbar_wait(smem_u32(&s_bar[s]), (u32)(t / PS_STAGES) & 1u);  // use t / S of stage s
#endif
        __syncthreads();  // tile t landed for everyone; stage (t - 1) % S is no longer read
        if (tid == 0 && t < PS_NSTAMPED) { st_g[2 + t] = gtimer(); st_c[2 + t] = clk64(); }
        const int n = t + PS_STAGES - 1;
        if (n < T) load(n, n % PS_STAGES);
#if PS_MODE == 0
        cp_async_commit();  // one group per tile, empty ones included
#endif
        const unsigned char* sp = smem + s * PS_STAGE_BYTES;
#pragma unroll
        for (int j = 0; j < PS_READ; ++j) {
            const int w = (tid + j * PS_THREADS + t * PS_READ * PS_THREADS) & (PS_WORDS_PER_HALF - 1);
            const int o = (w >> 4) * PS_PITCH + (w & 15) * 16;
            acc += sum8(*reinterpret_cast<const uint4*>(sp + o));
            acc += sum8(*reinterpret_cast<const uint4*>(sp + PS_HALF + o));
        }
    }
    sink[(u64)c * PS_THREADS + tid] = acc;
}

// SM clock against globaltimer over ``span_ns``, and the smallest globaltimer step seen.
extern "C" __global__ void probe_calib(u64* out, u64 span_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const u64 g0 = gtimer(), c0 = clk64();
    u64 g = g0, prev = g0, step = ~0ull;
    while (g - g0 < span_ns) {
        g = gtimer();
        if (g != prev) {
            if (g - prev < step) step = g - prev;
            prev = g;
        }
    }
    const u64 c1 = clk64();
    out[0] = g - g0;
    out[1] = c1 - c0;
    out[2] = step;
}
""".replace("N_SLOT_", str(N_SLOT)).replace("MAX_TILES_", str(MAX_TILES))


def options(mode: str, stages: int, threads: int) -> tuple[str, ...]:
    return ("-std=c++17", f"-DPS_MODE={MODES[mode]}", f"-DPS_STAGES={stages}", f"-DPS_THREADS={threads}")


def smem_bytes(mode: str, stages: int) -> int:
    return stages * 2 * ROWS * PITCH[mode]


def configs(n_sm: int) -> list[dict]:
    out = []

    def add(group, mode, stages, threads, grid, tiles, pattern):
        out.append({"name": f"{group}/{mode}/S{stages}/NT{threads}/{pattern}", "group": group, "mode": mode,
                    "stages": stages, "threads": threads, "grid": grid, "tiles": tiles, "pattern": pattern})

    for pattern in ("seq", "rand"):
        for s in (2, 3, 4, 6):
            add("idle", "cpasync", s, 128, 36, 16, pattern)
        add("idle", "cpasync", 3, 256, 36, 16, pattern)
        for mode in ("bulk_row", "bulk_block"):
            for s in (3, 6):
                add("idle", mode, s, 128, 36, 16, pattern)
    for mode in MODES:
        add("single", mode, 3, 128, 1, 32, "rand")
    for mode in MODES:
        add("reuse", mode, 3, 128, 144, 2, "rand")
    for mode in MODES:
        add("saturated", mode, 3, 128, 2 * n_sm, 32, "seq")
    return out


def nvcc_check(nvcc: str, arch: str = "sm_90") -> int:
    """Compile every (mode, stages, threads) variant with nvcc; returns the number of failures."""
    variants = sorted({(c["mode"], c["stages"], c["threads"]) for c in configs(132)})
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe_stream.cu"
        src.write_text(SRC)
        for mode, s, nt in variants:
            cmd = [nvcc, f"-arch={arch}", "-cubin", "-o", str(Path(tmp) / "out.cubin"), "-Xptxas", "-v",
                   *options(mode, s, nt), str(src)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            ok = res.returncode == 0
            failures += not ok
            # ptxas -v lines of probe_stream (the last entry function): registers, spills, smem
            tail = res.stderr.split("entry function 'probe_stream'")[-1].splitlines()
            info = [ln.split(": ")[-1].strip() for ln in tail if "registers" in ln or "spill" in ln]
            print(f"{'ok' if ok else 'FAILED':6s} {mode:10s} S{s} NT{nt:<3d} dynamic smem "
                  f"{smem_bytes(mode, s)} B  " + "; ".join(info))
            if not ok:
                print(res.stderr)
    return failures


def _reference(K: torch.Tensor, V: torch.Tensor, pages: torch.Tensor, threads: int) -> torch.Tensor:
    """The kernel's sink: per CTA and thread, the float sum of its consumed K and V words."""
    grid, T = pages.shape
    Kw, Vw = K.view(P, ROWS * D // 8, 8), V.view(P, ROWS * D // 8, 8)
    tid = torch.arange(threads, device=K.device)[:, None]
    j = torch.arange(4, device=K.device)[None, :]
    acc = torch.zeros(grid, threads, dtype=torch.float32, device=K.device)
    for t in range(T):
        w = (tid + j * threads + t * 4 * threads) % (ROWS * D // 8)
        pg = pages[:, t][:, None, None]
        acc += Kw[pg, w[None]].float().sum((-1, -2)) + Vw[pg, w[None]].float().sum((-1, -2))
    return acc


def _med(x) -> float:
    x = list(x)
    return float(statistics.median(x)) if x else float("nan")


def run(out: Path, iters: int, warmup: int) -> int:
    import cupy

    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    n_sm = props.multi_processor_count
    torch.manual_seed(0)
    K = torch.randn(P, ROWS, D, dtype=torch.bfloat16, device="cuda")
    V = torch.randn(P, ROWS, D, dtype=torch.bfloat16, device="cuda")
    flush = torch.ones(64 << 20, dtype=torch.float32, device="cuda")  # 256 MB, read before each launch
    g = torch.Generator().manual_seed(1234)
    orders = {"seq": torch.arange(P, dtype=torch.int32), "rand": torch.randperm(P, generator=g).to(torch.int32)}
    idx = {k: torch.cat([v, v]).cuda() for k, v in orders.items()}  # circular: windows may wrap
    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream (lserve's loader uses it too)
        warnings.simplefilter("ignore", DeprecationWarning)
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(dev).cuda_stream, dev)

    modules: dict = {}

    def kernel(mode, s, nt, name="probe_stream"):
        key = (mode, s, nt)
        if key not in modules:
            modules[key] = cupy.RawModule(code=SRC, options=options(mode, s, nt), backend="nvrtc")
        return modules[key].get_function(name)

    # SM clock (for the clock64 intervals) and globaltimer step, before and after the configs.
    calib_buf = torch.zeros(3, dtype=torch.int64, device="cuda")

    def calibrate() -> dict:
        with stream:
            kernel("cpasync", 3, 128, "probe_calib")((1,), (32,), (np.uint64(calib_buf.data_ptr()), np.uint64(2_000_000)))
        stream.synchronize()
        ns, cyc, step = (int(v) for v in calib_buf.cpu())
        return {"span_ns": ns, "cycles": cyc, "sm_ghz": cyc / ns, "globaltimer_step_ns": step}

    report = {"device": torch.cuda.get_device_name(dev), "date": datetime.datetime.now().astimezone().isoformat(),
              "sm_count": n_sm, "torch": torch.__version__, "cupy": cupy.__version__,
              "pool": {"pages": P, "rows": ROWS, "head_dim": D, "dtype": "bf16", "tile_bytes": TILE_BYTES},
              "iters": iters, "warmup": warmup, "calib_before": calibrate(), "configs": []}
    ghz = report["calib_before"]["sm_ghz"]
    print(f"{report['device']}  {n_sm} SMs  SM clock {ghz:.3f} GHz  globaltimer step "
          f"{report['calib_before']['globaltimer_step_ns']} ns", flush=True)

    n_bad = 0
    for cfg in configs(n_sm):
        mode, s, nt, grid, T = cfg["mode"], cfg["stages"], cfg["threads"], cfg["grid"], cfg["tiles"]
        assert T <= MAX_TILES and grid * T <= P
        kern = kernel(mode, s, nt)
        smem = smem_bytes(mode, s)
        if smem > 48 * 1024:
            kern.max_dynamic_shared_size_bytes = smem
        stamps = torch.zeros(grid, 2, N_SLOT, dtype=torch.int64, device="cuda")
        sink = torch.zeros(grid, nt, dtype=torch.float32, device="cuda")
        n_pages = grid * T
        bases = [(i * n_pages) % P for i in range(warmup + iters)]
        ix = idx[cfg["pattern"]]
        events = []
        with stream:
            for base in bases:
                flush.sum()  # same stream: torch's current stream is the one cupy wraps
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                args = (np.uint64(K.data_ptr()), np.uint64(V.data_ptr()), np.uint64(ix.data_ptr() + 4 * base),
                        np.int32(T), np.uint64(stamps.data_ptr()), np.uint64(sink.data_ptr()))
                e0.record(stream)
                kern((grid,), (nt,), args, shared_mem=smem)
                e1.record(stream)
                events.append((e0, e1))
        stream.synchronize()
        times_us = [cupy.cuda.get_elapsed_time(a, b) * 1e3 for a, b in events[warmup:]]
        kernel_us = _med(times_us)

        st = stamps.cpu().numpy()
        gt, ck = st[:, 0, :], st[:, 1, :]
        nrec = min(T, N_STAMPED)
        landed = gt[:, 2:2 + nrec]
        iv = np.diff(landed, axis=1).ravel()
        iv_ck = np.diff(ck[:, 2:2 + nrec], axis=1).ravel()
        interval_us = _med(iv) / 1e3
        interval_clk_us = _med(iv_ck) / ghz / 1e3
        r = dict(cfg)
        r.update({
            "smem_bytes": smem,
            "kernel_us": kernel_us, "kernel_us_all": times_us,
            "setup_us": _med(gt[:, 1] - gt[:, 0]) / 1e3,
            "first_tile_us": _med(gt[:, 2] - gt[:, 0]) / 1e3,
            "first_tile_after_setup_us": _med(gt[:, 2] - gt[:, 1]) / 1e3,
            "last_stamped_tile_us": _med(landed[:, -1] - gt[:, 0]) / 1e3,
            "cta_start_spread_us": float(gt[:, 0].max() - gt[:, 0].min()) / 1e3,
            "interval_us": interval_us, "interval_p10_us": float(np.percentile(iv, 10)) / 1e3 if iv.size else None,
            "interval_p90_us": float(np.percentile(iv, 90)) / 1e3 if iv.size else None,
            "interval_clk_cycles": _med(iv_ck), "interval_clk_us": interval_clk_us,
            "per_cta_gbps": TILE_BYTES / (interval_us * 1e3) if interval_us > 0 else None,
            "per_cta_gbps_clk": TILE_BYTES / (interval_clk_us * 1e3) if interval_clk_us > 0 else None,
            "aggregate_gbps": grid * T * TILE_BYTES / (kernel_us * 1e3),
        })
        # Correctness: the last launch's sink against torch over the same pages.
        pages = ix[bases[-1]:bases[-1] + n_pages].view(grid, T).long()
        ref = _reference(K, V, pages, nt)
        err = float((sink - ref).abs().max())
        ok = bool(torch.allclose(sink, ref, rtol=1e-4, atol=1e-3)) and bool((gt[:, 2:2 + nrec] > 0).all())
        n_bad += not ok
        r.update({"check": "OK" if ok else "MISMATCH", "check_max_abs_err": err})
        report["configs"].append(r)
        per_cta = "-" if r["per_cta_gbps"] is None else f"{r['per_cta_gbps']:6.1f}"
        print(f"{r['group']:9s} {mode:10s} S{s} NT{nt:<3d} grid {grid:3d} T {T:2d} {cfg['pattern']:4s}: "
              f"kernel {kernel_us:7.2f} us  setup {r['setup_us']:5.2f}  first tile {r['first_tile_us']:5.2f} us  "
              f"tile every {interval_us:5.2f} us (clk {interval_clk_us:5.2f})  {per_cta} GB/s/CTA  "
              f"aggregate {r['aggregate_gbps']:7.1f} GB/s  {r['check']}", flush=True)

    report["calib_after"] = calibrate()
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_stream.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'probe_stream.json'}" + (f"  ({n_bad} MISMATCH)" if n_bad else ""))
    return 1 if n_bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help="output directory (probe_stream.json)")
    ap.add_argument("--iters", type=int, default=20, help="timed launches per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="untimed launches before them")
    ap.add_argument("--nvcc-check", action="store_true", help="compile every variant with nvcc and exit (no GPU)")
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    a = ap.parse_args(argv)
    if a.nvcc_check:
        return 1 if nvcc_check(a.nvcc) else 0
    if a.out is None:
        ap.error("OUT_DIR is required")
    return run(Path(a.out), a.iters, a.warmup)


if __name__ == "__main__":
    sys.exit(main())
