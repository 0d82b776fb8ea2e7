"""Block-sparse prefill attention on the GPU: one layer of Llama-3-8B shape (32 query / 8 KV heads,
head_dim 128, bf16, batch 1, half the KV heads streaming), against SDPA in the same run.

    python -m lserve.bench.sparse_prefill OUT_DIR [--contexts 32768 131072] [--taus 0.5 0.25]

Per context:

* ``sdpa_all_ms``: causal SDPA on all 32 heads (the dense model's prefill attention).
* ``sdpa_dense_heads_ms``: causal SDPA on the 16 query heads of the 4 dense KV heads (what
  LServe runs for them today); ``streaming_ms``: the 4 streaming KV heads through ``ls_prefill``.
* per tau (random Q/K attend nearly uniformly, so the kept fraction follows tau): the estimate
  plus selection (``estimate_ms``, :func:`lserve.sparsity.prefill_blocks.prefill_blocks`), the
  attention on kept tiles (:func:`lserve.attention.block_sparse_prefill.sparse_prefill`) with the
  flash and with the cuDNN kernel (``sparse_flash_ms`` / ``sparse_cudnn_ms``), their TFLOP/s on the
  computed tiles against SDPA's on the dense heads, and ``all_heads_ms`` = streaming + estimate +
  the faster sparse path, the prefill attention LServe with prefill sparsity runs.
* rows of 1024 / 2048 / 4096 queries at the middle tau (``q_block_ms``).

Timing: CUDA events after warm-up, medians. Writes ``sparse_prefill_h200.json`` (+ ``.png``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lserve.attention.block_sparse_prefill import sparse_prefill
from lserve.bench.kernels import LOCAL, median_events, prefill_backend, with_pages
from lserve.bench.report import header, write_json
from lserve.models.presets import layer_config
from lserve.plotting import pyplot
from lserve.sparsity.prefill_blocks import prefill_blocks

CONTEXTS = (32768, 65536, 131072, 262144)
TAUS = (0.75, 0.5, 0.25, 0.1)
BLOCK, Q_BLOCK, STRIDE = 64, 2048, 16
LAYER = layer_config("llama3-8b")
H, HKV, D, HD = LAYER.num_heads, LAYER.num_kv_heads, LAYER.head_dim, LAYER.num_kv_heads // 2  # 4 dense KV heads


def _row(context: int, taus, iters: int) -> dict:
    from lserve.sparsity.plan import SeqStep

    G, scale = H // HKV, D ** -0.5
    q = torch.randn(context, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(context, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(context, HKV, D, device="cuda", dtype=torch.bfloat16)
    qt, kt, vt = (x.transpose(0, 1) for x in (q, k, v))  # [H, L, D] views
    qd, kd, vd = qt[: HD * G], kt[:HD], vt[:HD]
    row = {"context": context}
    row["sdpa_all_ms"] = median_events(lambda: F.scaled_dot_product_attention(
        qt[None], kt[None], vt[None], is_causal=True, enable_gqa=True), iters)
    row["sdpa_dense_heads_ms"] = median_events(lambda: F.scaled_dot_product_attention(
        qd[None], kd[None], vd[None], is_causal=True, enable_gqa=True), iters)
    dense_flops = 4 * HD * G * D * context * (context + 1) / 2
    row["sdpa_dense_heads_tflops"] = dense_flops / (row["sdpa_dense_heads_ms"] * 1e-3) / 1e12
    be = prefill_backend(LAYER, HD, LOCAL)
    out = torch.empty_like(q)
    st = be.plan([with_pages(be, SeqStep(0, 0, context, False, [], []), context)]).tables
    row["streaming_ms"] = median_events(lambda: be.prefill_kernel(q, k, v, out, st, HD * G, (HKV - HD) * G, True),
                                        iters)
    row["taus"] = []
    for tau in taus:
        r = {"tau": tau}
        blocks = prefill_blocks(qd, kd, 0, BLOCK, scale, tau, "antidiagonal", STRIDE, Q_BLOCK)
        r["kept_fraction"] = round(blocks.kept_fraction(), 4)
        r["estimate_ms"] = median_events(
            lambda tau=tau: prefill_blocks(qd, kd, 0, BLOCK, scale, tau, "antidiagonal", STRIDE, Q_BLOCK), iters)
        fl = blocks.attention_flops(G, D)
        for impl in ("flash", "cudnn"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sparse_prefill(qd, kd, vd, blocks, scale, impl)
            torch.cuda.synchronize()
            r[f"sparse_{impl}_first_call_ms"] = (time.perf_counter() - t0) * 1e3  # cuDNN builds plans per shape
            ms = median_events(lambda b=blocks, i=impl: sparse_prefill(qd, kd, vd, b, scale, i), iters)
            r[f"sparse_{impl}_ms"] = ms
            r[f"sparse_{impl}_tflops"] = fl / (ms * 1e-3) / 1e12
            r[f"sparse_{impl}_vs_sdpa_tflops"] = r[f"sparse_{impl}_tflops"] / row["sdpa_dense_heads_tflops"]
        best = min(r["sparse_flash_ms"], r["sparse_cudnn_ms"])
        r["dense_heads_ms"] = r["estimate_ms"] + best
        r["dense_heads_speedup"] = row["sdpa_dense_heads_ms"] / r["dense_heads_ms"]
        r["all_heads_ms"] = row["streaming_ms"] + r["dense_heads_ms"]
        r["all_heads_vs_sdpa"] = row["sdpa_all_ms"] / r["all_heads_ms"]
        row["taus"].append({k: round(x, 4) if isinstance(x, float) else x for k, x in r.items()})
        print(f"  {context} tau {tau}: {row['taus'][-1]}", file=sys.stderr, flush=True)
    mid = taus[len(taus) // 2]
    row["q_block_ms"] = {}
    for qb in (1024, 2048, 4096):
        b = prefill_blocks(qd, kd, 0, BLOCK, scale, mid, "antidiagonal", STRIDE, qb)
        est = median_events(lambda qb=qb: prefill_blocks(qd, kd, 0, BLOCK, scale, mid, "antidiagonal", STRIDE, qb),
                            iters)
        att = median_events(lambda b=b: sparse_prefill(qd, kd, vd, b, scale, "flash"), iters)
        row["q_block_ms"][qb] = {"tau": mid, "kept_fraction": round(b.kept_fraction(), 4),
                                 "estimate_ms": round(est, 3), "sparse_flash_ms": round(att, 3)}
    return {k: round(x, 4) if isinstance(x, float) else x for k, x in row.items()}


def _plot(report: dict, png: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for row in report["rows"]:
        ks = [t["kept_fraction"] for t in row["taus"]]
        a.plot(ks, [t["all_heads_vs_sdpa"] for t in row["taus"]], "o-", label=f"{row['context'] // 1024}k")
        b.plot(ks, [t["sparse_flash_vs_sdpa_tflops"] for t in row["taus"]], "o-", label=f"flash {row['context'] // 1024}k")
        b.plot(ks, [t["sparse_cudnn_vs_sdpa_tflops"] for t in row["taus"]], "s--", label=f"cuDNN {row['context'] // 1024}k")
    a.set_xlabel("kept fraction of causal tiles (dense heads)")
    a.set_ylabel("prefill attention speedup vs SDPA, all heads")
    a.grid(alpha=0.3)
    a.legend()
    b.axhline(0.7, color="gray", ls=":")
    b.set_xlabel("kept fraction")
    b.set_ylabel("TFLOP/s on computed tiles / SDPA dense")
    b.grid(alpha=0.3)
    b.legend(fontsize=7)
    fig.suptitle(f"block-sparse prefill, one Llama-3-8B layer ({report['device']})")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def run(out_dir: str, contexts=CONTEXTS, taus=TAUS, name: str = "sparse_prefill_h200") -> dict:
    """Measure every context; write ``{name}.json`` after each and the PNG at the end."""
    report = {**header(), "block": BLOCK, "q_block": Q_BLOCK, "stride": STRIDE,
              "shape": {"heads": H, "kv_heads": HKV, "dense_kv_heads": HD, "head_dim": D}, "rows": []}
    out = Path(out_dir)
    for ctx in contexts:
        t0 = time.perf_counter()
        report["rows"].append(_row(ctx, taus, 3 if ctx >= 65536 else 5))
        print(f"sparse prefill {ctx}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
        write_json(out / f"{name}.json", report)
    _plot(report, out / f"{name}.png")
    return report


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--taus", type=float, nargs="+", default=list(TAUS))
    p.add_argument("--name", default="sparse_prefill_h200")
    a = p.parse_args(argv)
    rep = run(a.out, a.contexts, a.taus, a.name)
    for row in rep["rows"]:
        for t in row["taus"]:
            print(f"{row['context']:>7} tau {t['tau']:<5} kept {t['kept_fraction']:.3f}  est {t['estimate_ms']:.1f} ms  "
                  f"flash {t['sparse_flash_ms']:.1f} ({t['sparse_flash_vs_sdpa_tflops']:.2f}x TF)  cudnn "
                  f"{t['sparse_cudnn_ms']:.1f} ({t['sparse_cudnn_vs_sdpa_tflops']:.2f}x TF)  all heads "
                  f"{t['all_heads_ms']:.1f} vs sdpa {row['sdpa_all_ms']:.1f} ms: {t['all_heads_vs_sdpa']:.2f}x")


if __name__ == "__main__":
    main()
