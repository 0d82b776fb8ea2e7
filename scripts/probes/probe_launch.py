"""Decode-step probe (issue 3): programmatic dependent launch (``CupyBackend.pdl``) off and on,
the CUDA-core page scores against the tensor-core ones, and text-edited kernel sources
(VARIANTS), one layer of Llama-3-8B shape (bf16, batch 1).

    python scripts/probes/probe_launch.py OUT_DIR [--contexts 65536 131072 262144]

Per context and variant: our dense decode (8 dense heads), the LServe cycle (4 streaming +
4 dense heads, budget 4096, reuse 4: one select step + three reuse steps), its select and reuse
steps, and the selector alone; SDPA once per context. CUDA-graph timings as in
``lserve bench kernels``. Writes probe_launch.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from kernel_edits import use_edited  # scripts/probes/kernel_edits.py (run as python scripts/probes/...)

from lserve.bench import kernels as kb

LAYER = kb.layer_config(kb.DEFAULT_MODEL)  # the Llama-3-8B layer these probes time

# name: (backend attributes, {kernel family: text edits of the shipped source})
VARIANTS = {
    "plain": ({"pdl": False}, {}),
    "pdl": ({}, {}),
    # The CUDA-core page-score kernel instead of the tensor-core one.
    "pdl-cuda-scores": ({"score_impl": "cuda"}, {}),
    # The decode kernel waits before reading the stored selection even on reuse steps.
    "pdl-sel-after-wait": ({}, {"decode_tc": [("const bool early_sel = sel_ready != 0;",
                                                 "const bool early_sel = false;")]}),
    # The top-k without its linear-histogram pass (the radix select alone, as before).
    "pdl-radix-topk": ({}, {"selector": [("if (k < ncand && span > 0.f", "if (false && span > 0.f")]}),
    # The page-score kernel triggers the top-k's launch at its start (the first PDL version).
    "pdl-scores-early-trigger": ({}, {"selector_tc": [("    // Host-copied tables only before the wait;",
                                                        "    pdl_trigger();\n    // Host-copied tables only before the wait;")]}),
}


def _set(s, attrs: dict, edits: dict) -> None:
    for be in s.backends.values():
        be.pdl, be.score_impl = attrs.get("pdl", True), attrs.get("score_impl", "tc")
        be.clear_kernel_overrides()  # back to the shipped sources
        for family, ed in edits.items():
            use_edited(be, family, ed)


def _dense_ms(s, inner: int) -> float:
    be, (sel, _) = s.backends[0], s.tables[0]
    return kb.graph_time(lambda i: be.decode(0, s.q[i % s.n_sets], s.out, sel[i % s.n_sets]), inner)


def _lserve_times(s, inner: int) -> dict:
    return {"lserve_ms": kb.graph_time(s.cycle_step, s.cycle_steps()),
            "select_step_ms": kb.graph_time(s.select_step, inner),
            "reuse_step_ms": kb.graph_time(s.reuse_step, inner),
            "selector_ms": kb.graph_time(s.selector, inner)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--contexts", type=int, nargs="+", default=[65536, 131072, 262144])
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "variants": {k: {"attrs": v[0], "edits": v[1]}
                                                                    for k, v in VARIANTS.items()}, "rows": []}
    for ctx in a.contexts:
        n_sets, inner = kb.rotation(LAYER, ctx)
        row = {"context": ctx, "sdpa_ms": kb.sdpa_decode_ms(LAYER, ctx, n_sets, inner), "runs": []}
        torch.cuda.empty_cache()
        dense = kb.DecodeSetup(LAYER, ctx, 8, n_sets)
        ls = kb.DecodeSetup(LAYER, ctx, 4, n_sets)
        ls.select_all()
        for name, (attrs, edits) in VARIANTS.items():
            _set(dense, attrs, edits)
            _set(ls, attrs, edits)
            r = {"variant": name, "dense_ms": _dense_ms(dense, inner)}
            r.update(_lserve_times(ls, inner))
            row["runs"].append(r)
            print(f"{ctx:>7} {name:>24}: dense {r['dense_ms'] * 1e3:7.2f} us "
                  f"(sdpa {row['sdpa_ms'] * 1e3:7.2f}, x{r['dense_ms'] / row['sdpa_ms']:.3f})  "
                  f"lserve {r['lserve_ms'] * 1e3:6.2f} us (sdpa/lserve {row['sdpa_ms'] / r['lserve_ms']:5.2f})  "
                  f"select step {r['select_step_ms'] * 1e3:6.2f}  reuse step {r['reuse_step_ms'] * 1e3:6.2f}  "
                  f"selector {r['selector_ms'] * 1e3:6.2f}", flush=True)
        del dense, ls
        torch.cuda.empty_cache()
        report["rows"].append(row)
    (out / "probe_launch.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
