"""Nsight Compute over the block-sparse prefill kernel: where each tile-shape variant stalls.

    python scripts/probes/probe_bsp_ncu.py OUT_DIR [--variants ws_s3 v4_s2] [--context 32768]
    (on the GPU machine: PARTS=probe PROBE=bsp_ncu PROBE_ARGS="..." bash scripts/gpu_run.sh)

Issue 35's kernel reaches 0.46x cuDNN's TFLOP/s and a rewrite from reasoning alone (v4) came out
slower, so the next step is measured: per variant, ``ncu`` profiles one launch on the dense heads
of a llama3-8b layer with every block kept (the bench's row, after warm-up launches) and this
writes ``ncu_<variant>.txt``: the details page (throughputs, occupancy, registers, shared memory,
warp state statistics: the stall reasons per issued instruction) and the source page's hottest
SASS lines by stall samples. ``--clock-control none`` leaves the clocks as the timings see them.

The child mode (``--launch VARIANT``) is what ``ncu`` runs: the inputs, ``--warmup`` launches and
one more, which is the profiled one.
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys
from pathlib import Path

KERNEL = "regex:ls_bsp_prefill"
TOP_SASS = 40  # source lines kept per variant, by stall samples


def launch(variant: str, context: int, warmup: int) -> None:
    """Build the bench's dense-heads row at ``context`` and launch ``variant`` ``warmup + 1`` times."""
    import torch

    from lserve.attention import paged_prefill as bsp
    from lserve.bench.bsp_prefill import SHAPES, layer_inputs, layer_shape

    shape = layer_shape()
    hd, d = shape.dense_kv_heads, shape.head_dim
    q, k, v, pool, pages = layer_inputs(shape, context)
    p = bsp.plan([bsp.PrefillSeq(0, 0, context, 0, None)], shape.group, hd, "cuda", SHAPES[variant])
    out = torch.empty_like(q)
    for _ in range(warmup + 1):
        bsp.run(q, k, v, out, p, hd, 0, hd, d ** -0.5, pool=pool, pages=pages)
    torch.cuda.synchronize()


def _ncu() -> str:
    found = shutil.which("ncu")
    if found:
        return found
    for cand in sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu")) + [Path("/usr/local/cuda/bin/ncu")]:
        if cand.exists():
            return str(cand)
    raise SystemExit("probe_bsp_ncu: no ncu on this machine")


def _hot_source(ncu: str, rep: Path) -> str:
    """The SASS lines with the most stall samples (the source page as CSV, re-sorted)."""
    r = subprocess.run([ncu, "--import", str(rep), "--page", "source", "--csv", "--print-source", "sass"],
                       capture_output=True, text=True)
    rows = list(csv.reader(io.StringIO(r.stdout)))
    if len(rows) < 2:
        return f"(no source page: {r.stderr.strip()[:300]})"
    head = rows[0]
    col = next((i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")), None)
    if col is None:
        return "(no stall sampling column)\n" + ",".join(head)
    body = [x for x in rows[1:] if len(x) > col and x[col].replace(".", "", 1).isdigit()]
    body.sort(key=lambda x: float(x[col]), reverse=True)
    out = io.StringIO()
    csv.writer(out).writerows([head] + body[:TOP_SASS])
    return out.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--variants", nargs="+", default=["ws_s3", "v4_s2"])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--launch", default=None, help=argparse.SUPPRESS)  # the child ncu profiles
    a = ap.parse_args(argv)
    if a.launch:
        launch(a.launch, a.context, a.warmup)
        return 0
    if not a.out:
        ap.error("OUT_DIR is required")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ncu = _ncu()
    rc = 0
    for var in a.variants:
        rep = out / f"ncu_{var}"
        cmd = [ncu, "--clock-control", "none", "-k", KERNEL, "--launch-skip", str(a.warmup), "--launch-count", "1",
               "--set", "full", "--import-source", "no", "-f", "-o", str(rep),
               sys.executable, __file__, "--launch", var, "--context", str(a.context), "--warmup", str(a.warmup)]
        print(" ".join(cmd), flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            print(r.stdout[-2000:], r.stderr[-2000:], flush=True)
            rc = 1
            continue
        details = subprocess.run([ncu, "--import", f"{rep}.ncu-rep", "--page", "details"],
                                 capture_output=True, text=True).stdout
        text = f"# {var} at {a.context}: {' '.join(cmd)}\n\n{details}\n# hottest SASS by stall samples\n"
        text += _hot_source(ncu, Path(f"{rep}.ncu-rep"))
        (out / f"ncu_{var}.txt").write_text(text)
        Path(f"{rep}.ncu-rep").unlink(missing_ok=True)  # the device returns at most 8 files
        print(details[:6000], flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
