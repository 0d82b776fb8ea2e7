"""Does torch's cuDNN attention align a causal mask to the lower right when Lq < Lk, and what
does a new shape cost it? (A chunk of a prefill attends to its past and itself in one call only
with lower-right alignment; cuDNN builds an execution plan per new shape.)

    python scripts/probes/probe_cudnn_causal.py OUT_DIR

Writes ``probe_cudnn_causal.json``. A probe, not a benchmark.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from lserve.bench.report import header


def ref(q, k, v, lower_right: bool):
    s = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    lq, lk = s.shape[-2], s.shape[-1]
    keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq if lower_right else 0)
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v.float()


def cudnn(q, k, v):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, True, False)[0]


def main() -> None:
    out = Path(sys.argv[1])
    dev, bf = "cuda", torch.bfloat16
    rows = []
    q = torch.randn(1, 8, 256, 128, device=dev, dtype=bf)
    k, v = (torch.randn(1, 8, 640, 128, device=dev, dtype=bf) for _ in "kv")
    try:
        o = cudnn(q, k, v).float()
        err = {name: float((o - ref(q, k, v, lr)).norm() / ref(q, k, v, lr).norm())
               for name, lr in (("lower_right", True), ("top_left", False))}
        rows.append({"check": "causal alignment, Lq 256 < Lk 640", "rel_err": err})
    except RuntimeError as e:
        rows.append({"check": "causal alignment", "error": str(e).splitlines()[0][:300]})
    for lq, lk in ((4096, 8192), (4096, 12288), (4096, 8192), (2048, 20480), (2048, 20480 + 64)):
        q = torch.randn(1, 32, lq, 128, device=dev, dtype=bf)
        k, v = (torch.randn(1, 32, lk, 128, device=dev, dtype=bf) for _ in "kv")
        try:
            torch.cuda.synchronize()
            t = time.perf_counter()
            cudnn(q, k, v)
            torch.cuda.synchronize()
            first = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(5):
                cudnn(q, k, v)
            torch.cuda.synchronize()
            again = (time.perf_counter() - t) / 5
            fl = 4 * lq * lk * 128 * 32
            rows.append({"lq": lq, "lk": lk, "first_call_s": round(first, 3), "cached_ms": round(1e3 * again, 2),
                         "tflops_no_mask_equiv": round(fl / again / 1e12, 1)})
        except RuntimeError as e:
            rows.append({"lq": lq, "lk": lk, "error": str(e).splitlines()[0][:300]})
        print(json.dumps(rows[-1]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_cudnn_causal.json").write_text(json.dumps({**header(), "rows": rows}, indent=1))
    print(json.dumps(rows[0]))


if __name__ == "__main__":
    main()
