"""``lserve bench prefill-sparsity``: kept tile fraction and true attention mass recalled by the
block-sparse prefill estimators (:mod:`lserve.sparsity.prefill_blocks`), per layer and KV head.

The model prefills a generated passkey prompt per context in one chunk with every head dense;
each layer's RoPE'd Q/K are scored exactly (oracle) and by each estimator, then cut at each tau
with the engine's rule (:func:`~lserve.sparsity.prefill_blocks.select_blocks`: rows of ``q_block``
queries, one kept count per row for every KV head). For each (layer, estimator, tau) the report
gives per KV head the kept fraction, the fraction that head alone would keep, the exact mass its
tiles hold and the exact best list with the same tiles per row (oracle at the same kept fraction).
The engine also keeps the prompt's last ``q_block`` positions dense (``dense_from``); the bench
measures the cut alone and does not apply that rule.
"""

from __future__ import annotations

import time
from pathlib import Path

from lserve.config import SparsityConfig
from lserve.eval.harness import PRESET_CONFIGS

# Defaults: the eval preset with prefill sparsity on (tau, rows of queries) and the engine's
# block and antidiagonal stride.
_PRESET = PRESET_CONFIGS["lserve-prefill-sparse"]
TAUS = (_PRESET.prefill_sparsity, 0.95)
Q_BLOCK = _PRESET.prefill_q_block
BLOCK = SparsityConfig.prefill_block
STRIDE = SparsityConfig.prefill_stride
CONTEXTS = (2048, 4096, 8192)
ESTIMATORS = ("antidiagonal", "bound", "oracle")
PASSKEY_DEPTH = 0.5


def run_prefill_sparsity(out_dir: str, contexts=CONTEXTS, taus=TAUS, block: int = BLOCK, q_block: int = Q_BLOCK,
                         stride: int = STRIDE, name: str = "prefill_sparsity_cpu", model: str = "default",
                         progress: bool = True) -> dict:
    """Measure; write ``<out_dir>/<name>.json``, then ``<name>.png`` and ``<name>_layers.png``.

    Parameters
    ----------
    out_dir : str
        Output directory.
    contexts : sequence of int
        Prompt lengths (one passkey prompt each, depth :data:`PASSKEY_DEPTH`, seed 0).
    taus : sequence of float
        Estimated mass each row keeps (``prefill_sparsity``).
    block, q_block, stride : int
        Keys per KV block, queries per row (a multiple of ``block``), antidiagonal stride.
    name : str
        Output file stem.
    model : str
        Model spec for :func:`lserve.models.loader.load_model` (``"tiny"`` for tests).
    progress : bool
        Print a line per layer as it is measured.

    Returns
    -------
    dict
        The report: :func:`lserve.bench.report.header` fields, settings, ``summary`` (means per
        context, tau and estimator) and ``rows`` (per context, layer, tau, estimator; lists per KV head).
    """
    import torch

    from lserve.bench.report import header, write_json
    from lserve.calibration.prefill import capture_prefill_qk
    from lserve.config import CacheConfig, EngineConfig
    from lserve.engine import LLMEngine
    from lserve.eval.tasks import make_passkey_case
    from lserve.models.loader import load_model
    from lserve.sparsity.prefill_blocks import (
        combine_group,
        estimate_masses,
        oracle_at_counts,
        recalled_mass,
        select_blocks,
    )

    if q_block % block or block % stride:
        raise ValueError(f"need q_block % block == 0 and block % stride == 0, got {q_block}, {block}, {stride}")
    t0 = time.perf_counter()
    loaded = load_model(model, dtype=torch.float32, device="cpu")
    mc = loaded.config
    g, scale = mc.group_size, mc.head_dim ** -0.5
    rows, seconds = [], {}
    for ctx in contexts:
        tc = time.perf_counter()
        case = make_passkey_case(loaded.tokenizer, ctx, PASSKEY_DEPTH, seed=0)
        max_len = ctx + 256
        eng = LLMEngine(EngineConfig(model=model, sparsity=SparsityConfig(pattern=None, token_budget=0),
                                     cache=CacheConfig(dense_pool_tokens=max_len), max_num_seqs=1,
                                     max_batched_tokens=max_len, max_model_len=max_len), loaded)
        try:
            captured = capture_prefill_qk(eng, case.prompt_ids)
        except RuntimeError as e:  # the masses assume the whole prompt in one chunk from position 0
            raise RuntimeError(f"context {ctx}: {e}") from None
        del eng
        for layer in sorted(captured):
            tl = time.perf_counter()
            q, k = captured.pop(layer)  # [Hq, L, D], [Hkv, L, D]
            L, hkv = k.shape[1], k.shape[0]
            exact_q = estimate_masses(q, k, 0, block, scale, "oracle", stride, q_block)  # [Hq, R, nkb]
            exact = combine_group(exact_q, g)  # [Hkv, R, nkb]
            for est in ESTIMATORS:
                # One estimate per estimator, cut at every tau (prefill_blocks without dense_from).
                mass = exact if est == "oracle" else combine_group(
                    estimate_masses(q, k, 0, block, scale, est, stride, q_block), g)
                for tau in taus:
                    blocks = select_blocks(mass, tau, 0, L, block, q_block)
                    best = oracle_at_counts(exact, blocks)
                    causal = blocks.causal_tiles()
                    bm = blocks.block_mask()
                    # What each head alone would keep: the shared count is the most any head needs.
                    alone = [select_blocks(mass[h: h + 1], tau, 0, L, block, q_block).kept_fraction()
                             for h in range(hkv)]
                    rows.append({"context": ctx, "layer": layer, "tau": tau, "estimator": est,
                                 "kept_fraction": [round(float(bm[h].sum()) / causal, 5) for h in range(hkv)],
                                 "head_alone_kept_fraction": [round(x, 5) for x in alone],
                                 "mass": _per_kv(recalled_mass(exact_q, blocks, g), g),
                                 "oracle_same_kept_mass": _per_kv(recalled_mass(exact_q, best, g), g)})
            if progress:
                r = next(x for x in rows[::-1] if x["layer"] == layer and x["estimator"] == "antidiagonal"
                         and x["tau"] == taus[0])
                print(f"prefill-sparsity: context {ctx} layer {layer + 1}/{mc.num_layers}: antidiagonal tau "
                      f"{taus[0]} kept {_mean(r['kept_fraction']):.3f} mass {_mean(r['mass']):.4f} "
                      f"({time.perf_counter() - tl:.1f} s)", flush=True)
        seconds[ctx] = round(time.perf_counter() - tc, 1)
        if progress:
            print(f"prefill-sparsity: context {ctx} done in {seconds[ctx]} s", flush=True)
    report = {**header(), "model": mc.name, "num_layers": mc.num_layers, "num_kv_heads": mc.num_kv_heads,
              "group_size": g, "contexts": list(contexts), "taus": list(taus), "estimators": list(ESTIMATORS),
              "block": block, "q_block": q_block, "stride": stride, "dense_from": None,
              "passkey": {"depth": PASSKEY_DEPTH, "seed": 0},
              "seconds": round(time.perf_counter() - t0, 1), "seconds_by_context": seconds,
              "summary": _summary(rows), "rows": rows}
    out = Path(out_dir)
    write_json(out / f"{name}.json", report)
    from lserve.bench.prefill_sparsity_plot import plot_kept_by_layer, plot_kept_heatmaps

    plot_kept_heatmaps(report, out / f"{name}.png")
    plot_kept_by_layer(report, out / f"{name}_layers.png")
    if progress:
        for s in report["summary"]:
            print(f"{s['context']:>6} tau {s['tau']:<5} {s['estimator']:<13} kept {s['kept_fraction']:.3f} "
                  f"mass {s['mass']:.4f} oracle at same kept {s['oracle_same_kept_mass']:.4f}")
        print(f"wrote {out / name}.json ({report['seconds']} s)")
    return report


def _per_kv(per_q, g: int) -> list[float]:
    """[Hq] tensor -> mean over each KV head's query group, rounded."""
    return [round(x, 5) for x in per_q.view(-1, g).mean(1).tolist()]


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def _summary(rows: list[dict]) -> list[dict]:
    """Means over layers and KV heads per (context, tau, estimator)."""
    out: dict[tuple, list] = {}
    for r in rows:
        out.setdefault((r["context"], r["tau"], r["estimator"]), []).append(r)
    keys = ("kept_fraction", "head_alone_kept_fraction", "mass", "oracle_same_kept_mass")
    return [{"context": ctx, "tau": tau, "estimator": est,
             **{key: round(_mean([x for r in rs for x in r[key]]), 4) for key in keys}}
            for (ctx, tau, est), rs in sorted(out.items())]
