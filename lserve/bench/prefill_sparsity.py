"""``lserve bench prefill-sparsity``: kept block fraction and true attention mass recalled by the
block-sparse prefill estimators (:mod:`lserve.sparsity.prefill_blocks`), per layer and KV head.

The default model prefills generated passkey prompts in one chunk with every head dense; each
layer's RoPE'd Q/K are scored exactly (oracle) and by both estimators at each tau. For each
estimator the report gives the kept fraction, the exact mass its tiles hold, and the exact best
list with the same number of tiles per row (oracle at the same kept fraction).
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def run_prefill_sparsity(out_dir: str, contexts=(2048, 4096), taus=(0.9, 0.95), block: int = 64,
                         name: str = "prefill_sparsity_cpu", model: str = "default") -> dict:
    """Measure and write ``<out_dir>/<name>.json``; returns the report."""
    import torch

    from lserve.config import CacheConfig, EngineConfig, SparsityConfig
    from lserve.engine import LLMEngine, SamplingParams
    from lserve.eval.tasks import make_passkey_case
    from lserve.models.loader import load_model
    from lserve.sparsity.prefill_blocks import (
        combine_group,
        estimate_masses,
        oracle_at_counts,
        prefill_blocks,
        recalled_mass,
    )

    t0 = time.perf_counter()
    loaded = load_model(model, dtype=torch.float32, device="cpu")
    mc = loaded.config
    g, scale = mc.group_size, mc.head_dim ** -0.5
    rows = []
    for ctx in contexts:
        case = make_passkey_case(loaded.tokenizer, ctx, 0.5, seed=0)
        max_len = ctx + 256
        eng = LLMEngine(EngineConfig(model=model, sparsity=SparsityConfig(pattern=None, token_budget=0),
                                     cache=CacheConfig(max_tokens=max_len), max_num_seqs=1,
                                     max_batched_tokens=max_len, max_model_len=max_len), loaded)
        captured = {}
        orig = eng.backend.run

        def run(layer, q, k, v, plan, _orig=orig, _cap=captured):
            if q.shape[0] > 1:
                _cap[layer] = (q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous())  # [H, L, D]
            return _orig(layer, q, k, v, plan)

        eng.backend.run = run
        eng.generate([case.prompt_ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        for layer in sorted(captured):
            q, k = captured[layer]
            exact_q = estimate_masses(q, k, 0, block, scale, "oracle")  # [Hq, R, nkb]
            exact = combine_group(exact_q, g)
            for tau in taus:
                for est in ("antidiagonal", "bound", "oracle"):
                    blocks = prefill_blocks(q, k, 0, block, scale, tau, est)
                    best = oracle_at_counts(exact, blocks)
                    bm = blocks.block_mask()
                    kept = [float(bm[h].sum()) / blocks.causal_tiles() for h in range(k.shape[0])]
                    rec = recalled_mass(exact_q, blocks, g).view(-1, g).mean(1).tolist()
                    rec_best = recalled_mass(exact_q, best, g).view(-1, g).mean(1).tolist()
                    rows.append({"context": ctx, "layer": layer, "tau": tau, "estimator": est,
                                 "kept_fraction": kept, "mass": rec, "oracle_same_kept_mass": rec_best})
    report = {"command": f"lserve bench prefill-sparsity --contexts {' '.join(map(str, contexts))}",
              "device": "cpu", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "model": mc.name,
              "block": block, "taus": list(taus), "seconds": round(time.perf_counter() - t0, 1),
              "summary": _summary(rows), "rows": rows}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    Path(out_dir, f"{name}.json").write_text(json.dumps(report, indent=1))
    return report


def _summary(rows: list[dict]) -> list[dict]:
    """Means over layers and heads per (context, tau, estimator)."""
    out: dict[tuple, list] = {}
    for r in rows:
        out.setdefault((r["context"], r["tau"], r["estimator"]), []).append(r)
    res = []
    for (ctx, tau, est), rs in sorted(out.items()):
        def mean(key, rs=rs):
            vals = [x for r in rs for x in r[key]]
            return round(sum(vals) / len(vals), 4)

        res.append({"context": ctx, "tau": tau, "estimator": est, "kept_fraction": mean("kept_fraction"),
                    "mass": mean("mass"), "oracle_same_kept_mass": mean("oracle_same_kept_mass")})
    return res
