"""Selector probe (issue 3): kernel-level times of the page selector and a LServe decode step at
256k, one layer of Llama-3-8B shape, from CUPTI (torch.profiler) and CUDA-graph replays.

    python scripts/probes/probe_selector.py OUT_DIR [--contexts 65536 262144]

Prints, per context: graph-timed scores with several pages-per-CTA settings; the top-k cut
short after each of its stages (TOPK_EDITS); the CUPTI duration
of every kernel of a select step and of a reuse step, with the statistics L2-hot (replayed on the
same data) and L2-cold (a 256 MB write in between); a D2D copy of the statistics' size. Writes
probe_selector.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from kernel_edits import use_edited  # scripts/probes/kernel_edits.py (run as python scripts/probes/...)
from torch.profiler import ProfilerActivity, profile

from lserve.bench import kernels as kb

LAYER = kb.layer_config(kb.DEFAULT_MODEL)  # the Llama-3-8B layer these probes time


def cupti_ms(fn, iters: int = 20) -> dict[str, float]:
    """Median CUPTI duration (ms) of each kernel name launched by ``fn`` (eager), over iters."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:60]].append(e.device_time_total / 1e3)
    return {k: round(statistics.median(v), 5) for k, v in per.items()}


# Text edits of selector.cu that isolate one cost (their results are wrong by design: timing only).
EDITS = {
    "scores_loads_only": [("""        float x[NV];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float mx[8], mn[8];""", """        float x[NV];
        u32 xa = 0u;
#pragma unroll
        for (int j = 0; j < 4; ++j) xa ^= T.mx[j].a.x ^ T.mx[j].a.y ^ T.mx[j].a.z ^ T.mx[j].a.w ^ T.mn[j].a.x ^
                                         T.mn[j].a.y ^ T.mn[j].a.z ^ T.mn[j].a.w;
#pragma unroll
        for (int v = 0; v < NV; ++v) x[v] = __uint_as_float(xa & 0x3fffffffu);
#pragma unroll
        for (int j = 0; j < 0; ++j) {
            float mx[8], mn[8];"""), ("        ReduceScatter<NV, LPT / 2>::run(x, li);\n", "")],
    "scores_l2_resident": [("const i64 off = ((page * g_log + T.j0 + j) * hd + h) * D + d0;",
                            "const i64 off = ((i64)(T.j0 + j) * hd + h) * D + d0 + 0 * page;")],
}
# Edits of ls_page_topk that end it early (uniformly, every thread) after a stage: the time up
# to each stage, as a graph node of the top-k alone.
_TK_WAIT = ("    pdl_wait();  // the scores (and the selection state this overwrites) belong to earlier kernels\n"
            "    pdl_trigger();\n")
TOPK_EDITS = {
    "topk_exit_after_wait": [(_TK_WAIT, _TK_WAIT + "    if (r >= 0) return;\n")],
    "topk_exit_after_keys": [("        const u32 bit = 1u << sr;\n",
                              "        if (sr >= 0) return;\n        const u32 bit = 1u << sr;\n")],
    "topk_exit_after_hist": [("            topk_find_bin(s_hist, k, s_scan, &s_digit, &s_above, &s_cnt);\n",
                              "            topk_find_bin(s_hist, k, s_scan, &s_digit, &s_above, &s_cnt);\n"
                              "            if (sr >= 0) return;\n")],
    "topk_exit_before_compaction": [("    // Compact the marked pages in ascending order",
                                     "    if (ncand >= 0) return;\n    // Compact the marked pages in ascending order")],
}


def probe(ctx: int, bw: float, flush: torch.Tensor) -> dict:
    """One context's row (see the module docstring)."""
    s = kb.DecodeSetup(LAYER, ctx, 4, 1)
    be = s.backends[kb.BUDGET]
    sel, reuse = s.tables[kb.BUDGET]
    row = {"context": ctx, "selector_bytes": s.selector_bytes(),
           "floor_ms": s.selector_bytes() / (bw * 1e12) * 1e3}
    be.select(0, s.q[0], sel[0])
    for ppb in (None, 4, 8, 16, 32, 64, 128):
        be.tune(score_ppb=ppb)
        row[f"scores_ppb{ppb}_ms"] = kb.graph_time(lambda i: be.select(0, s.q[0], sel[0], only="scores"), 32)
    be.tune(score_ppb=None)
    row["topk_ms"] = kb.graph_time(lambda i: be.select(0, s.q[0], sel[0], only="topk"), 32)
    row["selector_ms"] = kb.graph_time(lambda i: be.select(0, s.q[0], sel[0]), 32)
    impl, be.score_impl = be.score_impl, "cuda"  # EDITS change the CUDA-core score kernel
    for edit in EDITS:
        use_edited(be, "selector", EDITS[edit])
        row[f"{edit}_ms"] = kb.graph_time(lambda i: be.select(0, s.q[0], sel[0], only="scores"), 32)
        be.clear_kernel_overrides()  # back to the shipped sources
    be.score_impl = impl
    for edit in TOPK_EDITS:
        use_edited(be, "selector", TOPK_EDITS[edit])
        row[f"{edit}_ms"] = kb.graph_time(lambda i: be.select(0, s.q[0], sel[0], only="topk"), 32)
        be.clear_kernel_overrides()
    nbytes = s.selector_bytes()
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    row["copy_same_bytes_hot_ms"] = kb.graph_time(lambda i: dst.copy_(src), 32)

    def sel_step():
        be.select_stage(0, s.q[0], sel[0])
        be.decode(0, s.q[0], s.out, sel[0])

    def sel_step_cold():
        flush.fill_(1)
        sel_step()

    def reuse_step():
        be.decode(0, s.q[0], s.out, reuse[0])

    row["cupti_select_hot"] = cupti_ms(sel_step)
    row["cupti_select_cold"] = cupti_ms(sel_step_cold)
    row["cupti_reuse_hot"] = cupti_ms(reuse_step)
    row["cupti_copy_hot"] = cupti_ms(lambda: dst.copy_(src))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 262144])
    a = ap.parse_args()
    bw = kb.copy_bandwidth_tbps()
    res = {"copy_bandwidth_TBps": bw, "rows": []}
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for ctx in a.contexts:
        row = probe(ctx, bw, flush)
        res["rows"].append(row)
        print(json.dumps(row, indent=1), flush=True)
        torch.cuda.empty_cache()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "probe_selector.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
