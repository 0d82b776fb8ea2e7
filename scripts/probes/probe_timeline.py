"""Decode-step timeline probe (issue 3): when each CTA of each kernel of a step starts, passes
its PDL wait, sees its K/V tiles land and ends, from ``%globaltimer`` stamps written by
instrumented copies of the shipped kernels (text edits; the shipped sources are untouched).

    python scripts/probes/probe_timeline.py OUT_DIR [--context 262144]

Cases (one layer of Llama-3-8B shape, bf16, batch 1): the LServe reuse step and select step at
``--context`` (4 streaming + 4 dense heads, budget 4096), the same reuse step with longer units
(``min_chunk`` 8: per-tile rate of one CTA on an idle GPU), and our dense decode at 64k (per-tile
rate with HBM saturated). Each case is a CUDA graph of consecutive steps; the stamps are those
of the last step of a replay, in microseconds from the first stamp of that step. Writes
probe_timeline.json and prints, per kernel and mark, the CTA count and min / median / max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from lserve.kernels.loader import KERNEL_DIR

from lserve.bench import kernels as kb

LAYER = kb.layer_config(kb.DEFAULT_MODEL)  # the Llama-3-8B layer these probes time

N_CTA, N_SLOT = 4096, 16  # stamp rows (CTAs) and columns (0: SM id, 1..13: marks, 14/15: clock64)
_TL = r"""
__device__ unsigned long long ls_tl[N_CTA][N_SLOT];
__device__ __forceinline__ void ls_mark(int k) {
    if (threadIdx.x != 0) return;
    const int c = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (c >= N_CTA) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    unsigned long long clk;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(clk));
    if (k == 0) { unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); ls_tl[c][0] = s; ls_tl[c][N_SLOT - 2] = clk; }
    ls_tl[c][1 + k] = t;
    ls_tl[c][N_SLOT - 1] = clk;  // the SM clock at the latest mark (with slot N_SLOT - 2: the clock rate)
}
""".replace("N_CTA", str(N_CTA)).replace("N_SLOT", str(N_SLOT))

# family: (mark names, [(old, new)]); every kernel marks 0 at entry.
MARKS = {
    "decode_tc": (["entry", "tables", "waited", "tile0", "tile1", "tile2", "tile3", "tile8", "tile16",
                   "loop_end", "end", "ring_done", "warps_merged"], [
        ('#include "mma.cuh"\n', '#include "mma.cuh"\n' + _TL),
        ("    const bool early_sel = sel_ready != 0;", "    ls_mark(0);\n    const bool early_sel = sel_ready != 0;"),
        ("    if (!dyn || early_sel) pdl_wait();", "    ls_mark(1);\n    if (!dyn || early_sel) pdl_wait();\n    ls_mark(2);"),
        ("        ring_next<STAGES>(t, ntiles, load_tile);  // tile t landed; stage (t-1) % STAGES refilled\n",
         "        ring_next<STAGES>(t, ntiles, load_tile);\n"
         "        if (t < 4) ls_mark(3 + t); else if (t == 8) ls_mark(7); else if (t == 16) ls_mark(8);\n"),
        ("    cp_async_wait<0>();\n    __syncthreads();  // the K/V ring", "    ls_mark(9);\n    cp_async_wait<0>();\n"
         "    __syncthreads();\n    ls_mark(11);  // the K/V ring"),
        ("    __syncthreads();\n    // Per query head: each warp's weight",
         "    __syncthreads();\n    ls_mark(12);\n    // Per query head: each warp's weight"),
        ("= s_lse[tid];\n}", "= s_lse[tid];\n    ls_mark(10);\n}"),
    ]),
    "merge": (["entry", "waited", "end"], [
        ('#include "common.cuh"\n', '#include "common.cuh"\n' + _TL),
        ("    pdl_wait();  // the partials come from the decode kernel just before\n    pdl_trigger();\n",
         "    ls_mark(0);\n    pdl_wait();\n    pdl_trigger();\n    ls_mark(1);\n"),
        ("= f2act(O / L);\n    }\n}", "= f2act(O / L);\n    }\n    ls_mark(2);\n}"),
    ]),
    "selector_tc": (["entry", "waited", "end"], [
        ('#include "mma.cuh"\n', '#include "mma.cuh"\n' + _TL),
        ("    const int r = blockIdx.z;\n", "    ls_mark(0);\n    const int r = blockIdx.z;\n"),
        ("    pdl_wait();\n    if (p_begin >= npg) return;", "    pdl_wait();\n    ls_mark(1);\n    if (p_begin >= npg) return;"),
        ("= m[nt][e];\n                }\n        }\n    }\n}",
         "= m[nt][e];\n                }\n        }\n    }\n    ls_mark(2);\n}"),
    ]),
    "selector": (["entry", "waited", "marked", "end", "counted"], [
        ('#include "common.cuh"\n', '#include "common.cuh"\n' + _TL),
        ("    const int r = blockIdx.x, h = blockIdx.y;\n", "    ls_mark(0);\n    const int r = blockIdx.x, h = blockIdx.y;\n"),
        ("    pdl_trigger();\n    const int rows_per_seq", "    pdl_trigger();\n    ls_mark(1);\n    const int rows_per_seq"),
        ("    __syncthreads();\n    // Compact the marked pages",
         "    __syncthreads();\n    ls_mark(2);\n    // Compact the marked pages"),
        ("= total;\n}", "= total;\n    ls_mark(3);\n}"),
        ("    if (lane == 0) s_scan[warp] = wcnt;\n    __syncthreads();\n",
         "    if (lane == 0) s_scan[warp] = wcnt;\n    __syncthreads();\n    ls_mark(4);\n"),
    ]),
}
# Text edits of decode_tc that remove one part of a tile's work (wrong results by design).
ABLATIONS = {
    "shipped": [],
    "no K/V copies": [("        copy(t, stage, ntok, kbase, vbase, [&](int j) {",
                       "        if (ntok > 0) return;\n        copy(t, stage, ntok, kbase, vbase, [&](int j) {")],
    "no Q K^T mma": [("            mma_rows16(s, qa[kk], Ks, ROWP, kk * 16);\n"
                      "            mma_rows16(s2, qa[kk + 1], Ks, ROWP, (kk + 1) * 16);\n", "")],
    "no mask": [("                if (ok && !unmasked) {\n                    int ei, off;",
                 "                if (false) {\n                    int ei, off;")],
    # The K/V copies without the zero-fill operand (rows past the unit read row 0 instead).
    "cp.async without src-size": [('#include "mma.cuh"\n', (KERNEL_DIR / "mma.cuh").read_text().replace(
        'asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));',
        'asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");'))],
    "P V without the low half": [("            mma16816(o[dt], pl, b0, b1);\n"
                                  "            mma16816(o[dt + 1], pl, b2, b3);\n", "")],
}
KERNEL_OF = {"decode_tc": "ls_decode_tc", "merge": "ls_decode_merge", "selector_tc": "ls_page_scores_tc",
             "selector": "ls_page_topk"}


class Instrumented:
    """Stamped modules of the four families for a backend's variant; ``install`` points a backend at them."""

    def __init__(self, be, extra: dict | None = None) -> None:
        import cupy
        from lserve.kernels.loader import Variant, options_of, source_of

        self.mods, self.bufs = {}, {}
        for fam, (_, edits) in MARKS.items():
            src = source_of(fam)
            for a, b in edits + (extra or {}).get(fam, []):
                if src.count(a) != 1:
                    raise ValueError(f"{fam}: edit does not match exactly once: {a[:50]!r}")
                src = src.replace(a, b)
            mod = cupy.RawModule(code=src, options=options_of(Variant(fam, be.dt_name, be.D, "none", be.gq)),
                                 backend="nvrtc")
            self.mods[fam] = mod
            self.bufs[fam] = cupy.ndarray((N_CTA, N_SLOT), dtype=cupy.uint64, memptr=mod.get_global("ls_tl"))

    def install(self, be) -> None:
        be.clear_kernel_overrides()
        for fam, mod in self.mods.items():
            be.override_kernels(fam, mod, names=(KERNEL_OF[fam],))

    def clear(self) -> None:
        import cupy

        for b in self.bufs.values():
            b.fill(0)
        cupy.cuda.Device().synchronize()

    def read(self) -> dict:
        return {fam: b.get() for fam, b in self.bufs.items()}


def _last_step_stamps(ins: Instrumented, step, inner: int) -> dict:
    """Replay a graph of ``inner`` steps on cleared stamp buffers; per family the [CTA, slot] array."""
    kb.graph_time(step, inner, replays=5)  # warm (and the step time)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(inner):
            step(i)
    g.replay()
    torch.cuda.synchronize()
    ins.clear()
    g.replay()
    torch.cuda.synchronize()
    return ins.read()


def _summary(stamps: dict) -> dict:
    """Per family and mark: CTAs stamped, and min / median / max us from the step's first stamp."""
    marks = {fam: a[:, 1: N_SLOT - 2] for fam, a in stamps.items()}  # globaltimer columns only
    t0 = min(int(m[m > 0].min()) for m in marks.values() if (m > 0).any())
    out = {}
    for fam, a in stamps.items():
        names = MARKS[fam][0]
        rows = a[a[:, 1] > 0]
        if not len(rows):
            continue
        marks = rows[:, 1: N_SLOT - 2].astype("int64")
        span_ns = marks.max(axis=1) - marks[:, 0]
        cycles = rows[:, N_SLOT - 1].astype("int64") - rows[:, N_SLOT - 2].astype("int64")
        ghz = [c / t for c, t in zip(cycles.tolist(), span_ns.tolist()) if t > 500]
        per_sm = {}
        for sm in rows[:, 0].tolist():
            per_sm[sm] = per_sm.get(sm, 0) + 1
        fam_out = {"ctas": int(len(rows)), "sms": len(per_sm), "max_ctas_per_sm": max(per_sm.values()),
                   "sm_ghz": round(statistics.median(ghz), 3) if ghz else None, "marks": {}}
        for k, name in enumerate(names):
            col = rows[:, 1 + k]
            v = sorted((int(x) - t0) / 1e3 for x in col if x > 0)
            if v:
                fam_out["marks"][name] = {"n": len(v), "min": round(v[0], 3), "median": round(statistics.median(v), 3),
                                          "max": round(v[-1], 3)}
        out[fam] = fam_out
    return out


def _print(case: str, step_ms: float, summ: dict) -> None:
    print(f"== {case}: step {step_ms * 1e3:.2f} us (graph median)", flush=True)
    for fam, f in summ.items():
        print(f"  {KERNEL_OF[fam]:<18} ctas {f['ctas']:4d} on {f['sms']:3d} SMs (max {f['max_ctas_per_sm']}/SM), "
              f"SM clock {f['sm_ghz']} GHz")
        for name, m in f["marks"].items():
            print(f"    {name:<9} n {m['n']:4d}  min {m['min']:8.2f}  med {m['median']:8.2f}  max {m['max']:8.2f} us")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--context", type=int, default=262144)
    ap.add_argument("--cases", nargs="+", choices=["main", "ablate"], default=["main"])
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "marks": {f: m[0] for f, m in MARKS.items()}, "cases": []}

    def run(case, s, step, inner, be_keys, extra=None):
        ins = Instrumented(s.backends[be_keys[0]], extra)
        for k in be_keys:
            ins.install(s.backends[k])
        step_ms = kb.graph_time(step, inner)
        summ = _summary(_last_step_stamps(ins, step, inner))
        _print(case, step_ms, summ)
        report["cases"].append({"case": case, "step_ms": step_ms, "kernels": summ})

    ctx = a.context
    n_sets, inner = kb.rotation(LAYER, ctx)
    ls = kb.DecodeSetup(LAYER, ctx, 4, n_sets)
    ls.select_all()
    be = ls.backends[kb.BUDGET]

    def units(min_chunk, target=None, s=ls):
        s.backends[kb.BUDGET].tune(min_chunk=min_chunk, target_ctas=target)
        for t in s.tables[kb.BUDGET][1]:
            s.backends[kb.BUDGET].replan_units(t)

    if "main" in a.cases:
        run(f"lserve reuse step {ctx}", ls, ls.reuse_step, inner, [kb.BUDGET])
        run(f"lserve select step {ctx}", ls, ls.select_step, inner, [kb.BUDGET])
        units(8)
        run(f"lserve reuse step {ctx}, min_chunk 8", ls, ls.reuse_step, inner, [kb.BUDGET])
    if "ablate" in a.cases:  # per-tile costs: 8-tile units, one part of the tile's work removed each
        units(8)
        for name, edits in ABLATIONS.items():
            run(f"lserve reuse step {ctx}, min_chunk 8, {name}", ls, ls.reuse_step, inner, [kb.BUDGET],
                {"decode_tc": edits})
    units(2)
    del ls, be, units
    torch.cuda.empty_cache()

    if "main" in a.cases:
        n_sets, inner = kb.rotation(LAYER, 65536)
        dense = kb.DecodeSetup(LAYER, 65536, 8, n_sets)

        def dense_step(i):
            j = i % dense.n_sets
            dense.backends[0].decode(0, dense.q[j], dense.out, dense.tables[0][0][j])
        run("dense decode 65536", dense, dense_step, inner, [0])
    (out / "probe_timeline.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
