"""Decode split-K probe (issue 3): how the split-K granularity moves our dense decode against
SDPA, and the LServe reuse step, one layer of Llama-3-8B shape (bf16, batch 1).

    python scripts/probes/probe_decode.py OUT_DIR [--contexts 65536 131072 262144]

For each context: SDPA decode; our dense decode for several (units per launch, fewest entries
per unit) settings and for text-edited kernel sources (EDITS), with and without the split-K
merge; the LServe reuse step (50% streaming, budget 4096) for the same. CUDA-graph timings as in ``lserve bench kernels``.
Writes probe_decode.json.
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

# (units per launch as a multiple of the SM count or None = the default one wave, min_chunk)
SETTINGS = [(None, 2), (1, 2), (3, 2), (4, 2), (6, 2), (None, 8), (None, 16)]
# Text edits of decode_tc.cu timed against the shipped source at the default setting:
# {name: [(old text, new text), ...]}. Empty now; what was tried is in benchmarks/kernels/kernels_notes.md.
EDITS: dict[str, list[tuple[str, str]]] = {}


def _time_setting(s, be, tables, target, min_chunk, inner) -> tuple[float, float, int]:
    be.tune(target_ctas=None if target is None else target * be.num_sms, min_chunk=min_chunk)
    for t in tables:
        be.replan_units(t)

    def step(i, merge=True):
        j = i % s.n_sets
        be.decode(0, s.q[j], s.out, tables[j], merge=merge)

    full = kb.graph_time(step, inner)
    attn = kb.graph_time(lambda i: step(i, merge=False), inner)
    n_units = next(iter(tables[0].units.values())).n_units
    return full, attn, n_units


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--contexts", type=int, nargs="+", default=[65536, 131072, 262144])
    ap.add_argument("--settings", choices=["all", "default"], default="all",
                    help="'default': only the default split-K setting (with the source edits)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "settings": SETTINGS, "rows": []}
    for ctx in a.contexts:
        n_sets, inner = kb.rotation(LAYER, ctx)
        row = {"context": ctx, "sdpa_ms": kb.sdpa_decode_ms(LAYER, ctx, n_sets, inner), "dense": [], "reuse": []}
        torch.cuda.empty_cache()
        for n_dense, key, budget in ((8, "dense", 0), (4, "reuse", kb.BUDGET)):
            s = kb.DecodeSetup(LAYER, ctx, n_dense, n_sets)
            be = s.backends[budget]
            sel, reuse = s.tables[budget]
            tables = sel
            if budget:
                s.select_all()
                tables = reuse
            runs = [(t, m, None) for t, m in (SETTINGS if a.settings == "all" else SETTINGS[:1])]
            runs += [(None, 2, e) for e in EDITS]
            for target, mcn, edit in runs:
                if edit:
                    use_edited(be, "decode_tc", EDITS[edit])
                full, attn, nu = _time_setting(s, be, tables, target, mcn, inner)
                if edit:
                    be.clear_kernel_overrides()  # back to the shipped sources
                row[key].append({"target_x_sms": target, "min_chunk": mcn, "edit": edit, "units": nu, "ms": full,
                                 "attn_ms": attn})
                print(f"{ctx:>7} {key:>6} target={target} min_chunk={mcn} edit={edit} units={nu}: "
                      f"{full * 1e3:7.2f} us (attn {attn * 1e3:6.2f}) sdpa {row['sdpa_ms'] * 1e3:7.2f}", flush=True)
            del s
            torch.cuda.empty_cache()
        report["rows"].append(row)
    (out / "probe_decode.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
