"""The unified block-sparse prefill kernel (``kernels/bsp_prefill.cu``) on the GPU: parity against
the torch oracle, then speed at fixed kept fractions against cuDNN in the same run.

    python -m lserve.bench.bsp_prefill OUT_DIR [--model llama3-8b] [--contexts 32768 131072 262144]
        [--fractions 0.1 0.2 0.3 0.5]

1. ``parity``: fresh random inputs (never zeros), the output poisoned with NaN before each launch,
   against :func:`lserve.attention.paged_prefill.reference` (float32): GQA groups 1/4/5/7/8, head
   dims 64/128, page sizes 16/64 with shuffled pages, ragged lengths, a chunk with cached past,
   dense + streaming heads in one launch, block lists and every block kept. ``max_rel_err`` =
   max |out - ref| / max |ref| per case; a case passes below 2e-2 (bf16 P and output).
2. ``rows``: one attention layer of the ``--model`` preset (default llama3-8b: 32 query / 8 KV
   heads, D 128; qwen2.5-7b: 28 / 4, group 7), bf16, half the KV heads dense and half streaming
   (sink 128, local 256), pages of 64 in shuffled order. Per context: cuDNN SDPA causal on
   all heads and on the dense heads (its TFLOP/s is the peer); per tile-shape variant the kernel on
   the dense heads with every block kept (TFLOP/s vs cuDNN); per kept fraction (random lists,
   :func:`lserve.sparsity.prefill_blocks.fixed_fraction_blocks`): the kernel on the dense heads
   (TFLOP/s on computed tiles vs cuDNN dense), the gathered-cuDNN path today's backend runs on the
   same lists, and the whole layer in one launch (dense listed + streaming) against SDPA on all
   heads.
3. ``estimate`` per context: the dense heads' antidiagonal block-mass estimate at the engine's
   default block / q_block / stride, the torch code (:func:`lserve.sparsity.prefill_blocks.estimate_masses`)
   against the fused path (:func:`lserve.attention.prefill_estimate.antidiagonal_masses`), their
   largest mass difference, and the fused estimate plus the mass cut (``cut_blocks``; and the GPU cut, ``mass_cut``) as a share
   of SDPA on the dense heads (the issue's target: <= 5%); the fused path also at the other
   launch shapes of :data:`ESTIMATE_SHAPES` (``fused_gG_sZ_ms`` and its largest difference), and
   with the mass kernel's two-pass variant (``fused_2pass_*``).

CUDA events after warm-up, medians. Writes ``{name}.json`` (+ ``.png``).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lserve.attention import paged_prefill as bsp
from lserve.attention.block_sparse_prefill import sparse_prefill
from lserve.attention.prefill_cut import mass_cut
from lserve.attention.prefill_estimate import antidiagonal_masses
from lserve.bench.kernels import median_events
from lserve.bench.report import header, write_json
from lserve.config import ConfigError, SparsityConfig
from lserve.models.presets import layer_config
from lserve.plotting import pyplot
from lserve.sparsity.prefill_blocks import cut_blocks, estimate_masses, fixed_fraction_blocks

CONTEXTS = (32768, 131072, 262144)
FRACTIONS = (0.1, 0.2, 0.3, 0.5)
VARIANTS = (bsp.TileShape("mma", 2, 4), bsp.TileShape("mma", 1, 8), bsp.TileShape("wg", 1, 8),
            bsp.TileShape("wg", 1, 4), *(bsp.TileShape(i, 1, 8) for i in bsp.WS_IMPLS),
            *(bsp.TileShape(bsp.V4, 1, 8, stages=s) for s in bsp.V4_STAGES), bsp.TileShape(bsp.V5, 1, 8, stages=3),
            bsp.TileShape(bsp.V5, 1, 8, stages=3, persist=True))
# every shape --variants may name: VARIANTS (the default run, and the GPU test's parity) plus the
# warp-specialized kernels' other ring depths (v3 and v5; parity-checked by the run that names them) and
# the timing studies of "ws_s3" (bsp.ABLATIONS: speed only, no parity, never the rows' kernel)
SHAPES = {v.name: v for v in VARIANTS
          + tuple(bsp.TileShape(i, 1, 8, stages=s) for i in (*bsp.WS_IMPLS, bsp.V5) for s in (2, 4))
          + tuple(bsp.TileShape("ws", 1, 8, stages=3, ablate=a) for a in bsp.ABLATIONS)}
DEFAULT_MODEL = "llama3-8b"
# the estimate's launch shapes timed beside the default: (GEMMs per chunk, mass-kernel CTAs per row)
ESTIMATE_SHAPES = ((4, 1), (4, 4), (16, 8))
SINK, LOCAL = 128, 256
TOL = 2e-2


@dataclass(frozen=True)
class LayerShape:
    """The layer the rows time: query heads, KV heads (the first half dense, the rest streaming), head dim."""

    heads: int
    kv_heads: int
    head_dim: int

    @property
    def dense_kv_heads(self) -> int:
        return self.kv_heads // 2

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def layer_shape(model: str = DEFAULT_MODEL) -> LayerShape:
    """The attention layer of preset ``model`` (:func:`lserve.models.presets.layer_config`)."""
    mc = layer_config(model)
    return LayerShape(mc.num_heads, mc.num_kv_heads, mc.head_dim)


def report_name(model: str) -> str:
    """The default file stem: ``bsp_prefill_h200`` for the default model, else with the preset's name."""
    return "bsp_prefill_h200" if model == DEFAULT_MODEL else f"bsp_prefill_{model}_h200"


def shuffled_pages(k: torch.Tensor, v: torch.Tensor, n_dense: int, page: int, gen: torch.Generator):
    """Dense heads of k/v [L, H_kv, D] into a pool [P, n_dense, page, D] with shuffled pages."""
    L, _, d = k.shape
    n = -(-L // page)
    order = torch.randperm(n + 3, generator=gen)[:n]  # a few unused pages: ids are not 0..n-1
    pk = torch.randn(n + 3, n_dense, page, d, dtype=k.dtype, device=k.device)
    pv = torch.randn_like(pk)
    pad = n * page - L
    kk = F.pad(k[:, :n_dense], (0, 0, 0, 0, 0, pad)).view(n, page, n_dense, d).transpose(1, 2)
    vv = F.pad(v[:, :n_dense], (0, 0, 0, 0, 0, pad)).view(n, page, n_dense, d).transpose(1, 2)
    pk[order.to(k.device)] = kk
    pv[order.to(k.device)] = vv
    return (pk, pv), order.to(torch.int32)


def parity_case(name: str, group: int, d: int, hkv: int, n_dense: int, start: int, n: int, page: int,
                frac: float | None, variant, seed: int, q_block: int = 256) -> dict:
    """One launch of ``variant`` on fresh inputs against the oracle: ``hkv`` KV heads (the first
    ``n_dense`` dense, read from a pool of ``page``-key shuffled pages; streaming ones when ``start``
    is 0), ``n`` queries after ``start`` cached keys, a random list keeping ``frac`` (None: every block)."""
    gen = torch.Generator().manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    hq, L = hkv * group, start + n
    q = torch.randn(n, hq, d, generator=gen).to(dev, dt)
    k = torch.randn(L, hkv, d, generator=gen).to(dev, dt)
    v = torch.randn(L, hkv, d, generator=gen).to(dev, dt)
    pool, pages = shuffled_pages(k, v, n_dense, page, gen)
    blocks = fixed_fraction_blocks(n_dense, start, L, frac, bsp.BN, q_block, seed) if frac is not None else None
    streaming = start == 0
    scale = d ** -0.5
    p = bsp.plan([bsp.PrefillSeq(0, start, n, 0, blocks)], group, n_dense, dev, variant)
    out = torch.full_like(q, float("nan"))
    kn, vn = k[start:], v[start:]  # the step's own rows
    heads = hkv if streaming else n_dense
    bsp.run(q, kn, vn, out, p, n_dense, 0, heads, scale, SINK, LOCAL if streaming else 0, pool, pages.to(dev))
    torch.cuda.synchronize()
    ref = bsp.reference(q, k, v, start, n_dense, scale, blocks, SINK, LOCAL)
    got = out[:, : heads * group].float()
    ref = ref[:, : heads * group]
    err = float((got - ref).abs().max() / ref.abs().max()) if not got.isnan().any() else float("nan")
    return {"case": name, "group": group, "head_dim": d, "kv_heads": hkv, "dense_kv_heads": n_dense, "start": start,
            "new": n, "page_size": page, "kept_fraction": None if blocks is None else round(blocks.kept_fraction(), 3),
            "variant": variant.name, "max_rel_err": round(err, 5), "ok": err < TOL}


def parity(variants=VARIANTS, seed: int = 0) -> list[dict]:
    """Every parity case for every tile-shape variant (inputs drawn from ``seed`` onwards)."""
    cases = []
    for vi, var in enumerate(variants):
        if var.ablate:
            continue  # a timing study: its output is wrong by design
        for g, d, hkv, nd, start, n, page, frac in [
            (4, 128, 4, 2, 0, 1000, 64, 0.3),    # dense listed + streaming, ragged length
            (4, 128, 4, 2, 0, 777, 16, None),    # every block kept, small pages
            (1, 64, 3, 1, 0, 600, 64, 0.5),
            (7, 128, 2, 1, 0, 530, 64, 0.4),     # group 7: positions per tile not a power of two
            (5, 64, 2, 2, 0, 450, 32, None),
            (8, 128, 2, 1, 0, 900, 64, 0.25),
            (4, 128, 2, 2, 700, 300, 64, None),  # chunk with cached past (dense heads, paged)
            (7, 128, 2, 2, 640, 513, 16, 0.5),   # chunk with past and a block list
        ]:
            if not var.supports(d):
                continue  # the wgmma kernels are head_dim 128 only (TileShape.supports)
            name = f"g{g}_d{d}_h{hkv}_nd{nd}_s{start}_n{n}_p{page}_f{frac}"
            cases.append(parity_case(name, g, d, hkv, nd, start, n, page, frac, var, seed + 100 * vi + len(cases)))
            print(f"parity {var} {cases[-1]['case']}: {cases[-1]['max_rel_err']}", file=sys.stderr, flush=True)
    return cases


def _flops_dense(n_qheads: int, L: int, d: int) -> float:
    return 4.0 * n_qheads * d * L * (L + 1) / 2


def layer_inputs(shape: LayerShape, context: int):
    """A row's inputs: random bf16 q [L, H, D], k and v [L, H_kv, D] on the GPU (seeded by the
    context), the dense heads' pool with pages of 64 in shuffled order, and its page ids (CUDA)."""
    gen = torch.Generator().manual_seed(context)
    q = torch.randn(context, shape.heads, shape.head_dim, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(context, shape.kv_heads, shape.head_dim, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(context, shape.kv_heads, shape.head_dim, generator=gen).to("cuda", torch.bfloat16)
    pool, pages = shuffled_pages(k, v, shape.dense_kv_heads, 64, gen)
    return q, k, v, pool, pages.cuda()


def _row(shape: LayerShape, context: int, fractions, variants, iters: int) -> dict:
    HKV, D, HD = shape.kv_heads, shape.head_dim, shape.dense_kv_heads
    G, scale = shape.group, D ** -0.5
    q, k, v, pool, pages = layer_inputs(shape, context)
    qt, kt, vt = (x.transpose(0, 1) for x in (q, k, v))
    qd, kd, vd = qt[: HD * G], kt[:HD], vt[:HD]
    row = {"context": context}
    row["sdpa_all_ms"] = median_events(lambda: F.scaled_dot_product_attention(
        qt[None], kt[None], vt[None], is_causal=True, enable_gqa=True), iters)
    row["sdpa_dense_heads_ms"] = median_events(lambda: F.scaled_dot_product_attention(
        qd[None], kd[None], vd[None], is_causal=True, enable_gqa=True), iters)
    peer = _flops_dense(HD * G, context, D) / (row["sdpa_dense_heads_ms"] * 1e-3) / 1e12
    row["sdpa_dense_heads_tflops"] = peer
    out = torch.empty_like(q)
    seq = [bsp.PrefillSeq(0, 0, context, 0, None)]
    row["variants"] = {}
    for var in variants:
        p = bsp.plan(seq, G, HD, "cuda", var)
        ms = median_events(lambda p=p: bsp.run(q, k, v, out, p, HD, 0, HD, scale, pool=pool, pages=pages), iters)
        tf = _flops_dense(HD * G, context, D) / (ms * 1e-3) / 1e12
        row["variants"][var.name] = {"dense_ms": ms, "tflops": tf, "vs_cudnn": tf / peer, "ablation": bool(var.ablate)}
        print(f"  {context} {var.name}: {ms:.2f} ms, {tf:.0f} TF/s", file=sys.stderr, flush=True)
    best = min((var for var in variants if not var.ablate), key=lambda var: row["variants"][var.name]["dense_ms"])
    row["best_variant"] = best.name
    best_ms = row["variants"][best.name]["dense_ms"]
    contenders = [var for var in variants if not var.ablate and row["variants"][var.name]["dense_ms"] <= 1.5 * best_ms]
    p_all = bsp.plan(seq, G, HD, "cuda", best)
    row["streaming_ms"] = median_events(lambda: bsp.run(q, k, v, out, p_all, HD, HD, HKV - HD, scale, SINK, LOCAL),
                                        iters)
    row["estimate"] = _estimate_row(qd, kd, G, scale, row["sdpa_dense_heads_ms"], iters)
    print(f"  {context} estimate: {row['estimate']}", file=sys.stderr, flush=True)
    row["fractions"] = []
    for frac in fractions:
        blocks = fixed_fraction_blocks(HD, 0, context, frac, bsp.BN, 2048, seed=1)
        r = {"target": frac, "kept_fraction": round(blocks.kept_fraction(), 4)}
        fl = blocks.attention_flops(G, D)
        # the run's kernels within 1.5x of the fastest with every block kept, each at this fraction
        # (short rows may favour another shape); the row's figures are the fastest one's
        timed = {}
        for var in contenders:
            pv = bsp.plan([bsp.PrefillSeq(0, 0, context, 0, blocks)], G, HD, "cuda", var)
            timed[var.name] = (median_events(lambda p=pv: bsp.run(q, k, v, out, p, HD, 0, HD, scale, pool=pool,
                                                                    pages=pages), iters), pv)
        r["variant_dense_ms"] = {name: round(ms, 4) for name, (ms, _) in timed.items()}
        r["variant"] = min(timed, key=lambda name: timed[name][0])
        r["bsp_dense_ms"], p = timed[r["variant"]]
        r["bsp_tflops"] = fl / (r["bsp_dense_ms"] * 1e-3) / 1e12
        r["bsp_vs_cudnn_tflops"] = r["bsp_tflops"] / peer
        bd = blocks.__class__(blocks.indptr.cuda(), blocks.indices.cuda(), blocks.block, 0, context, blocks.q_block)
        sparse_prefill(qd, kd, vd, bd, scale, "cudnn")  # plans per shape, outside the timing
        r["gathered_cudnn_ms"] = median_events(lambda b=bd: sparse_prefill(qd, kd, vd, b, scale, "cudnn"), iters)
        r["bsp_all_heads_ms"] = median_events(lambda p=p: bsp.run(q, k, v, out, p, HD, 0, HKV, scale, SINK, LOCAL,
                                                                  pool, pages), iters)
        r["all_heads_vs_sdpa"] = row["sdpa_all_ms"] / r["bsp_all_heads_ms"]
        r["dense_heads_vs_sdpa"] = row["sdpa_dense_heads_ms"] / r["bsp_dense_ms"]
        r["bsp_vs_gathered"] = r["gathered_cudnn_ms"] / r["bsp_dense_ms"]
        row["fractions"].append({a: round(x, 4) if isinstance(x, float) else x for a, x in r.items()})
        print(f"  {context} kept {frac}: {row['fractions'][-1]}", file=sys.stderr, flush=True)
    return row


def _estimate_row(qd: torch.Tensor, kd: torch.Tensor, group: int, scale: float, sdpa_ms: float, iters: int) -> dict:
    """The antidiagonal estimate of a whole prompt's dense heads: torch vs fused, and with the cut."""
    sp = SparsityConfig()
    B, QB, S, L = sp.prefill_block, sp.prefill_q_block, sp.prefill_stride, kd.shape[1]
    ref = estimate_masses(qd, kd, 0, B, scale, "antidiagonal", S, QB)
    fused = antidiagonal_masses(qd, kd, 0, B, QB, scale, S)
    r = {"block": B, "q_block": QB, "stride": S, "max_abs_diff": float((ref - fused).abs().max())}
    r["torch_ms"] = median_events(lambda: estimate_masses(qd, kd, 0, B, scale, "antidiagonal", S, QB), iters)
    r["fused_ms"] = median_events(lambda: antidiagonal_masses(qd, kd, 0, B, QB, scale, S), iters)

    def cut(masses):  # the torch cut the engine runs on the estimate (off the cupy backend)
        return cut_blocks(masses, group, 0.5, 0, L, B, QB)

    r["fused_and_cut_ms"] = median_events(lambda: cut(antidiagonal_masses(qd, kd, 0, B, QB, scale, S)), iters)

    def gpu_cut(masses):  # the same cut in two kernels (kernels/prefill_cut.cu)
        return mass_cut(masses, group, 0.5, 0, L, B, QB)

    r["torch_cut_ms"] = median_events(lambda: cut(fused), iters)
    r["gpu_cut_ms"] = median_events(lambda: gpu_cut(fused), iters)
    a, b = cut(fused), gpu_cut(fused)
    r["gpu_cut_equal"] = bool(torch.equal(a.indptr, b.indptr) and torch.equal(a.indices, b.indices))
    r["fused_and_gpu_cut_ms"] = median_events(lambda: gpu_cut(antidiagonal_masses(qd, kd, 0, B, QB, scale, S)), iters)
    r["fused_and_gpu_cut_vs_sdpa_dense"] = r["fused_and_gpu_cut_ms"] / sdpa_ms
    r["speedup"] = r["torch_ms"] / r["fused_ms"]
    r["fused_and_cut_vs_sdpa_dense"] = r["fused_and_cut_ms"] / sdpa_ms
    # the fused path's other launch shapes (GEMMs per chunk x mass-kernel CTAs per row): ms, largest diff
    for g, z in ESTIMATE_SHAPES:
        run = functools.partial(antidiagonal_masses, qd, kd, 0, B, QB, scale, S, groups=g, splits=z)
        r[f"fused_g{g}_s{z}_ms"] = median_events(run, iters)
        r[f"fused_g{g}_s{z}_max_abs_diff"] = float((ref - run()).abs().max())
    # the mass kernel in two passes over the scores (the default shape), alone and with the cut
    two = functools.partial(antidiagonal_masses, qd, kd, 0, B, QB, scale, S, passes=2)
    r["fused_2pass_ms"] = median_events(two, iters)
    r["fused_2pass_max_abs_diff"] = float((ref - two()).abs().max())
    r["fused_2pass_and_cut_ms"] = median_events(lambda: cut(two()), iters)
    r["fused_2pass_and_cut_vs_sdpa_dense"] = r["fused_2pass_and_cut_ms"] / sdpa_ms
    return {a: round(x, 5) if isinstance(x, float) else x for a, x in r.items()}


def _plot(report: dict, png: Path) -> None:
    plt = pyplot()
    if plt is None or not report["rows"]:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for row in report["rows"]:
        ks = [f["kept_fraction"] for f in row["fractions"]]
        lab = f"{row['context'] // 1024}k"
        a.plot(ks, [f["all_heads_vs_sdpa"] for f in row["fractions"]], "o-", label=lab)
        b.plot(ks, [f["bsp_vs_cudnn_tflops"] for f in row["fractions"]], "o-", label=f"bsp {lab}")
        b.plot(ks, [f["bsp_vs_gathered"] for f in row["fractions"]], "s--", label=f"gathered/bsp time {lab}")
    a.set_xlabel("kept fraction of causal tiles (dense heads)")
    a.set_ylabel("layer prefill attention speedup vs cuDNN SDPA")
    a.grid(alpha=0.3)
    a.legend()
    b.axhline(0.75, color="gray", ls=":")
    b.set_xlabel("kept fraction")
    b.set_ylabel("ratio")
    b.grid(alpha=0.3)
    b.legend(fontsize=7)
    fig.suptitle(f"bsp_prefill kernel, one {report['model']} layer ({report['device']})")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def run(out_dir: str, contexts=CONTEXTS, fractions=FRACTIONS, variants=VARIANTS, name: str | None = None,
        skip_parity: bool = False, model: str = DEFAULT_MODEL) -> dict:
    """Parity first (speed is not measured if a case fails), then every context, on one layer of
    preset ``model``; writes ``{name}.json`` (default :func:`report_name`) under ``out_dir``."""
    shape = layer_shape(model)
    name = name or report_name(model)
    report = {**header(), "model": model,
              "shape": {"heads": shape.heads, "kv_heads": shape.kv_heads, "dense_kv_heads": shape.dense_kv_heads,
                        "head_dim": shape.head_dim, "sink": SINK, "local": LOCAL}, "parity": [], "rows": []}
    out = Path(out_dir)
    if not skip_parity:
        report["parity"] = parity(variants)
        write_json(out / f"{name}.json", report)
        bad = [c for c in report["parity"] if not c["ok"]]
        if bad:
            print(f"PARITY FAILED in {len(bad)} cases: {[(c['case'], c['variant']) for c in bad]}", flush=True)
            ok_vars = [v for v in variants if not any(c["variant"] == v.name for c in bad)]
            if not ok_vars:
                return report
            variants = tuple(ok_vars)
    for ctx in contexts:
        t0 = time.perf_counter()
        report["rows"].append(_row(shape, ctx, fractions, variants, 3 if ctx >= 131072 else 5))
        print(f"bsp prefill {ctx}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
        write_json(out / f"{name}.json", report)
    _plot(report, out / f"{name}.png")
    return report


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"preset whose layer the rows time (default {DEFAULT_MODEL})")
    p.add_argument("--name", default=None, help="file stem (default bsp_prefill_h200, or bsp_prefill_MODEL_h200)")
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--variants", nargs="+", default=[v.name for v in VARIANTS],
                   help="tile shapes by name (impl_mtM_wW; the warp-specialized kernels: ws_sS / wsp_sS / wsi_sS / "
                        "v4_sS / v5_sS, S stages)")
    a = p.parse_args(argv)
    bad = [n for n in a.variants if n not in SHAPES]
    if bad:
        p.error(f"unknown variant {bad[0]} (known: {', '.join(SHAPES)})")
    if all(SHAPES[n].ablate for n in a.variants):
        p.error("--variants needs a kernel that is not a timing study (the rows at kept fractions run it)")
    try:
        layer_shape(a.model)
    except ConfigError as e:
        p.error(str(e))
    rep = run(a.out, a.contexts, a.fractions, tuple(SHAPES[n] for n in a.variants), name=a.name,
              skip_parity=a.skip_parity, model=a.model)
    for c in rep["parity"]:
        print(f"parity {c['variant']} {c['case']}: {c['max_rel_err']} {'ok' if c['ok'] else 'FAIL'}")
    for r in rep["rows"]:
        vs = ", ".join(f"{k} {x['tflops']:.0f} TF/s ({x['vs_cudnn']:.2f}x cuDNN)" for k, x in r["variants"].items())
        print(f"{r['context']}: SDPA all {r['sdpa_all_ms']:.1f} ms, dense heads {r['sdpa_dense_heads_ms']:.1f} ms "
              f"({r['sdpa_dense_heads_tflops']:.0f} TF/s); dense bsp: {vs}; streaming {r['streaming_ms']:.1f} ms")
        e = r["estimate"]
        print(f"  estimate: torch {e['torch_ms']:.1f} ms, fused {e['fused_ms']:.2f} ms ({e['speedup']:.1f}x, max |diff| "
              f"{e['max_abs_diff']:.1e}), fused + cut {e['fused_and_cut_ms']:.2f} ms = "
              f"{100 * e['fused_and_cut_vs_sdpa_dense']:.1f}% of SDPA on the dense heads; two passes "
              f"{e['fused_2pass_ms']:.2f} ms (max |diff| {e['fused_2pass_max_abs_diff']:.1e}), + cut "
              f"{100 * e['fused_2pass_and_cut_vs_sdpa_dense']:.1f}%; cut torch {e['torch_cut_ms']:.3f} / GPU "
              f"{e['gpu_cut_ms']:.3f} ms (equal: {e['gpu_cut_equal']}), fused + GPU cut {e['fused_and_gpu_cut_ms']:.2f} ms = "
              f"{100 * e['fused_and_gpu_cut_vs_sdpa_dense']:.2f}%")
        for f in r["fractions"]:
            print(f"  kept {f['kept_fraction']:.3f}: bsp dense {f['bsp_dense_ms']:.1f} ms ({f['bsp_tflops']:.0f} TF/s, "
                  f"{f['bsp_vs_cudnn_tflops']:.2f}x cuDNN), gathered {f['gathered_cudnn_ms']:.1f} ms, all heads "
                  f"{f['bsp_all_heads_ms']:.1f} ms = {f['all_heads_vs_sdpa']:.2f}x SDPA")


if __name__ == "__main__":
    main()
