"""Which kernel SDPA runs for the engine's fresh-prompt GQA call, and how fast (one Llama-3-8B layer).

    python scripts/probes/probe_sdpa.py OUT_DIR [--contexts 32768 131072]

For each context: the dense heads' causal attention as ``CupyBackend.prefill`` calls it (q, k, v
views of one fused projection, ``enable_gqa``), under torch's default backend order and under
:func:`cudnn_first`; and cuDNN called directly on repeated K/V. Medians of CUDA events after
warm-up, and the attention kernels each one launched. Writes ``probe_sdpa_h200.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from lserve.attention.chunked import attention_lse
from lserve.bench.kernels import median_events
from lserve.bench.report import header


def cudnn_first():
    """A context in which SDPA tries cuDNN first (cuDNN ran causal attention at 128k 1.7x faster
    than flash on the H200, ``kernels_h200.json``); the engine's candidate fix if torch's own
    order turns out to pick flash for its fresh-prompt GQA call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH], set_priority=True)


def _probe(n: int, hq: int = 32, hkv: int = 8, d: int = 128) -> list[dict]:
    """Rows of one context: each call's median ms, error against the default call, kernels."""
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : hq * d].view(n, hq, d).transpose(0, 1)  # [Hq, n, D] strided, as the engine's
    k = qkv[:, hq * d: (hq + hkv) * d].view(n, hkv, d).transpose(0, 1)  # [Hkv, n, D]
    v = qkv[:, (hq + hkv) * d:].view(n, hkv, d).transpose(0, 1)
    g = hq // hkv

    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()  # layout suspect: strided views of one buffer

    def sdpa(ctx, contig=False):
        qq, kk, vv = (qc, kc, vc) if contig else (q, k, v)
        with ctx():
            return F.scaled_dot_product_attention(qq[None], kk[None], vv[None], is_causal=True, enable_gqa=True)[0]

    calls = {"sdpa_default": lambda: sdpa(contextlib.nullcontext), "sdpa_cudnn_first": lambda: sdpa(cudnn_first),
             "sdpa_default_contiguous": lambda: sdpa(contextlib.nullcontext, True),
             "sdpa_cudnn_first_contiguous": lambda: sdpa(cudnn_first, True),
             "cudnn_repeat_kv": lambda: attention_lse(q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0), True,
                                                      d ** -0.5, impl="cudnn")[0]}
    ref = calls["sdpa_default"]().float()
    rows = []
    for name, fn in calls.items():
        err = float((fn().float() - ref).norm() / ref.norm())
        ms = median_events(fn, 5)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = sorted({e.key[:90] for e in prof.key_averages()
                          if any(w in e.key.lower() for w in ("attention", "sdpa", "fmha", "flash"))})
        rows.append({"context": n, "call": name, "ms": round(ms, 3), "rel_err_vs_default": round(err, 5),
                     "kernels": kernels})
        print(f"{n:>7} {name:>18} {ms:9.2f} ms  err {err:.1e}  {kernels}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    a = ap.parse_args()
    rows = []
    for n in a.contexts:
        rows += _probe(n)
        torch.cuda.empty_cache()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "probe_sdpa_h200.json").write_text(json.dumps({**header(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
