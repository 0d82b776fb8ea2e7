"""``lserve bench selection-mass``: what loses attention mass at decode, the estimator, the page
granularity or the budget?

The model runs densely (every head reads every page; original head order) on the project's
long-context prompts (:mod:`lserve.eval.tasks`: passkey and NIAH at the given contexts, a seed
the accuracy harness does not use). At every decode step and layer, the decode query and the
cached keys give each KV head's exact attention probabilities (mean over its query heads: one
page list per KV head, the engine's ``select_mode="kv"``). From them, at each token budget:

* ``bound_pN_lM``: the mass of the pages the min/max upper-bound selector keeps
  (:func:`~lserve.sparsity.selector.page_scores`, physical page N, logical page M; at the
  engine's own page sizes the statistics are the cache's, else built from the keys);
* ``oracle_pN``: the mass of the best pages of size N (exact top-k by true mass);
* ``oracle_token``: the mass of the best single tokens (no page granularity at all).

So ``oracle_pN - bound_pN_lM`` is what the estimator loses, ``oracle_token - oracle_pN`` what
the page granularity loses, and ``1 - oracle_token`` what the budget itself loses. Reported per
layer as the mean over the heads that are dense under the learned pattern (the heads that would
select), also per head for the engine's page sizes (the curves the adaptive budgets calibrate from).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lserve.bench.report import header, write_json
from lserve.calibration.mass_curves import (
    kept_mass_curve,
    key_stats_from_keys,
    mass_at_budgets,
    page_mass,
    token_oracle_at_budgets,
)
from lserve.sparsity.selector import page_scores

# Budgets at which per-head curves are kept in the report (besides the table's budgets).
CURVE_BUDGETS = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144)


@dataclass
class SelectionMassConfig:
    """Settings of ``lserve bench selection-mass``.

    Parameters
    ----------
    budgets : tuple of int
        Token budgets of the table and the plot.
    page_configs : tuple of (int, int)
        (physical, logical) page sizes whose upper-bound selection is measured; the oracle is
        measured at every physical size listed.
    decode_steps : int
        Decode steps observed per prompt (the queries of the first generated tokens: the answer).
    seed : int
        Prompt seed (100: held out from ``lserve eval``'s 0, 1, ...).
    """

    model: str = "default"
    tasks: tuple[str, ...] = ("passkey", "niah")
    contexts: tuple[int, ...] = (2048, 4096, 8192)
    depths: tuple[float, ...] = (0.25, 0.75)
    samples: int = 1
    seed: int = 100
    decode_steps: int = 8
    budgets: tuple[int, ...] = (512, 1024, 2048, 4096)
    page_configs: tuple[tuple[int, int], ...] = ((16, 8), (16, 16), (32, 8), (32, 16), (64, 8), (64, 16))
    engine_page: tuple[int, int] = (64, 16)
    pattern: str = "auto"
    static_sparsity: float = 0.5
    device: str = "cpu"
    dtype: str = "float32"

    def grid(self) -> list[int]:
        """Every budget measured: the table's and the curves'."""
        return sorted(set(self.budgets) | set(CURVE_BUDGETS))

    def methods(self) -> list[str]:
        sizes = sorted({p for p, _ in self.page_configs}, reverse=True)
        bounds = [f"bound_p{p}_l{lg}" for p, lg in sorted(self.page_configs, key=lambda c: (-c[0], -c[1]))]
        return bounds + [f"oracle_p{p}" for p in sizes] + ["oracle_token"]


def layer_masses(q: torch.Tensor, k: torch.Tensor, scale: float, group: int, cfg: SelectionMassConfig,
                 engine_stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Mass kept by every method at every budget of ``cfg.grid()`` for one query of one layer.

    Parameters
    ----------
    q : torch.Tensor
        [H * G, D] decode query (RoPE applied) of the layer's KV heads' query heads.
    k : torch.Tensor
        [H, L, D] the cached keys.
    engine_stats : (kmax, kmin), optional
        [n, g, H, D] the cache's own statistics at ``cfg.engine_page`` (used for that bound).

    Returns
    -------
    dict
        method -> float32 [len(grid), H], each KV head's mass (mean over its query heads).
    """
    h, length, d = k.shape
    grid = cfg.grid()
    logits = torch.bmm(q.float().view(h, group, d), k.float().transpose(1, 2)) * scale  # [H, G, L]
    p = torch.softmax(logits, dim=-1).mean(1)  # [H, L]: kv-mode pages serve the whole group
    out = {"oracle_token": token_oracle_at_budgets(p, grid)}
    for size in sorted({s for s, _ in cfg.page_configs}):
        pm = page_mass(p, size)  # [H, n]
        out[f"oracle_p{size}"] = mass_at_budgets(kept_mass_curve(pm, pm), grid, size)
        for _, lg in (c for c in cfg.page_configs if c[0] == size):
            if engine_stats is not None and (size, lg) == tuple(cfg.engine_page):
                kmax, kmin = engine_stats
            else:
                kmax, kmin = key_stats_from_keys(k, size, lg)
            scores = page_scores(q, kmax, kmin, group, "kv")  # [H, n]
            out[f"bound_p{size}_l{lg}"] = mass_at_budgets(kept_mass_curve(pm, scores), grid, size)
    return out


class MassRecorder:
    """Wraps a torch backend's decode and accumulates :func:`layer_masses` per context.

    Attributes
    ----------
    sums : dict
        context -> method -> float64 [len(grid), L, H_kv] sums over observations.
    counts : dict
        context -> int64 [L] observations per layer.
    stats_gap : float
        Largest |cache statistics - statistics rebuilt from the keys| seen on full pages (a
        check that the rebuilt statistics are the engine's).
    """

    def __init__(self, backend, cfg: SelectionMassConfig) -> None:
        model = backend.model
        if any(n != model.num_kv_heads for n in backend.cache.n_dense):
            raise ValueError("the recorder needs an all-dense head layout (original head order)")
        if (backend.cache.page_size, backend.cache.stats[0].logical_page_size) != tuple(cfg.engine_page):
            raise ValueError("cfg.engine_page must be the engine cache's page sizes")
        self.backend, self.cfg = backend, cfg
        self.context = 0
        self.steps_left = 0
        self.sums: dict[int, dict[str, torch.Tensor]] = {}
        self.counts: dict[int, torch.Tensor] = {}
        self.stats_gap = 0.0
        self._inner = backend._decode
        backend._decode = self._decode  # this engine only: it exists for the measurement

    def start(self, context: int) -> None:
        """The next decode steps belong to a prompt of ``context`` tokens."""
        self.context = context
        n = self.backend.model.num_layers
        hk = self.backend.model.num_kv_heads
        self.sums.setdefault(context, {m: torch.zeros(len(self.cfg.grid()), n, hk, dtype=torch.float64)
                                       for m in self.cfg.methods()})
        self.counts.setdefault(context, torch.zeros(n, dtype=torch.long))

    def _decode(self, layer: int, sp, q: torch.Tensor) -> torch.Tensor:
        if sp.step.decode:
            self.observe(layer, sp, q)
        return self._inner(layer, sp, q)

    @torch.no_grad()
    def observe(self, layer: int, sp, q: torch.Tensor) -> None:
        b = self.backend
        k, _ = b.cache.dense[layer].sequence_kv(sp.pages, sp.length)  # [H, L, D]
        stats = b.cache.stats[layer]
        kmax, kmin = stats.kmax[sp.pages], stats.kmin[sp.pages]  # [n, g, H, D]
        if sp.n_pages > 1:
            rmax, rmin = key_stats_from_keys(k, *self.cfg.engine_page)
            gap = max((rmax[:-1] - kmax[:-1].float()).abs().max().item(),
                      (rmin[:-1] - kmin[:-1].float()).abs().max().item())
            self.stats_gap = max(self.stats_gap, gap)
        got = layer_masses(q, k, b.scale, b.group, self.cfg, (kmax, kmin))
        sums = self.sums[self.context]
        for m, v in got.items():
            sums[m][:, layer] += v.double().cpu()
        self.counts[self.context][layer] += 1


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


def summarize(rec: MassRecorder, cfg: SelectionMassConfig, dense: list[list[int]]) -> dict:
    """Per-layer means over dense heads, per-head means at the engine's page sizes, and gaps.

    Returns
    -------
    dict
        ``layers[ctx][method][budget]``: [L] mean over the layer's dense heads (None without any);
        ``heads[ctx][method][budget]``: [L][H] per KV head (engine-page bound and oracle only);
        ``overall[ctx][method][budget]``: mean over every dense head of every layer;
        ``worst_layer[ctx][method][budget]``: the lowest layer value;
        ``gaps[ctx][budget]``: estimator / granularity / budget losses (see module docstring).
    """
    grid = cfg.grid()
    p, lg = cfg.engine_page
    engine_bound, engine_oracle = f"bound_p{p}_l{lg}", f"oracle_p{p}"
    smallest = f"oracle_p{min(s for s, _ in cfg.page_configs)}"
    pairs = [(layer, h) for layer, heads in enumerate(dense) for h in heads]
    layers, heads, overall, worst, gaps = {}, {}, {}, {}, {}
    for ctx in sorted(rec.sums):
        cnt = rec.counts[ctx].double().clamp(min=1)  # [L]
        means = {m: s / cnt[None, :, None] for m, s in rec.sums[ctx].items()}  # [B, L, H]
        layers[ctx], heads[ctx], overall[ctx], worst[ctx] = {}, {}, {}, {}
        for m, t in means.items():
            layers[ctx][m], overall[ctx][m], worst[ctx][m] = {}, {}, {}
            if m in (engine_bound, engine_oracle):
                heads[ctx][m] = {}
            for i, b in enumerate(grid):
                per_layer = [_round(t[i, layer, hs].mean()) if hs and rec.counts[ctx][layer] else None
                             for layer, hs in enumerate(dense)]
                layers[ctx][m][b] = per_layer
                vals = [x for x in per_layer if x is not None]
                worst[ctx][m][b] = min(vals) if vals else None
                overall[ctx][m][b] = _round(sum(float(t[i, layer, h]) for layer, h in pairs) / len(pairs))
                if m in heads[ctx]:
                    heads[ctx][m][b] = [[_round(x) for x in row] for row in t[i].tolist()]
        o = overall[ctx]
        gaps[ctx] = {b: {"estimator": _round(o[engine_oracle][b] - o[engine_bound][b]),
                         "logical_page_8_vs_16": _round(o.get(f"bound_p{p}_l8", o[engine_bound])[b]
                                                        - o[engine_bound][b]),
                         "page_granularity": _round(o["oracle_token"][b] - o[engine_oracle][b]),
                         "page_size_smallest_vs_engine": _round(o[smallest][b] - o[engine_oracle][b]),
                         "budget": _round(1.0 - o["oracle_token"][b])} for b in cfg.budgets}
    return {"layers": layers, "heads": heads, "overall": overall, "worst_layer": worst, "gaps": gaps}


def table_lines(report: dict) -> list[str]:
    """The printed table: per context, mean mass over dense heads (worst layer) per method and budget."""
    budgets = report["settings"]["budgets"]
    lines = []
    for ctx, by_method in report["overall"].items():
        lines.append(f"context {ctx}: mass kept, mean over dense heads (worst layer in brackets)")
        lines.append(f"{'method':<18}" + "".join(f"{b:>15}" for b in budgets))
        for m, vals in by_method.items():
            w = report["worst_layer"][ctx][m]
            lines.append(f"{m:<18}" + "".join(f"{vals[b]:>8.3f} ({w[b]:.2f})" for b in budgets))
        g = report["gaps"][ctx]
        lines.append("mass lost to (mean over dense heads):")
        for key in ("estimator", "page_granularity", "budget"):
            lines.append(f"  {key:<16}" + "".join(f"{g[b][key]:>15.3f}" for b in budgets))
        lines.append("")
    return lines


def run_selection_mass(cfg: SelectionMassConfig, out_dir: str | Path = "benchmarks",
                       name: str = "selection_mass_cpu", progress: bool = True) -> dict:
    """Run the measurement; writes ``<name>.json`` and ``<name>.png`` under ``out_dir``.

    Returns
    -------
    dict
        The report (:func:`header` fields, settings, :func:`summarize`'s figures, ``table``).
    """
    from lserve.config import CacheConfig, EngineConfig, SparsityConfig
    from lserve.engine import LLMEngine, SamplingParams
    from lserve.engine.llm_engine import build_layout
    from lserve.eval.harness import EvalPlan
    from lserve.identity import identity
    from lserve.models.loader import load_model

    t0 = time.perf_counter()
    base = EngineConfig(model=cfg.model, device=cfg.device, dtype=cfg.dtype)
    loaded = load_model(cfg.model, dtype=base.torch_dtype(), device=cfg.device)
    mc = loaded.config
    plan = EvalPlan(tasks=list(cfg.tasks), contexts=list(cfg.contexts), depths=list(cfg.depths),
                    samples=cfg.samples, seed=cfg.seed)
    cases = plan.cases(loaded.tokenizer)
    page, logical = cfg.engine_page
    max_len = max(c.context for c in cases) + cfg.decode_steps + 2 * page
    sp = SparsityConfig(pattern=None, token_budget=0, dynamic_threshold=0, select_layers="none")
    cc = CacheConfig(page_size=page, logical_page_size=logical, dense_pool_tokens=max_len)
    engine = LLMEngine(EngineConfig(model=cfg.model, sparsity=sp, cache=cc, device=cfg.device, dtype=cfg.dtype,
                                    max_num_seqs=1, max_batched_tokens=max_len, max_model_len=max_len), loaded)
    rec = MassRecorder(engine.backend, cfg)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(cases), desc="selection-mass", unit="prompt", dynamic_ncols=True)
    for c in cases:
        rec.start(c.context)
        engine.generate([c.prompt_ids], SamplingParams(max_tokens=cfg.decode_steps + 1, temperature=0.0,
                                                       ignore_eos=True))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(ctx=c.context, task=c.task)
    if bar is not None:
        bar.close()
    pattern_cfg = EngineConfig(model=cfg.model, sparsity=SparsityConfig(
        pattern=cfg.pattern, static_sparsity=cfg.static_sparsity if cfg.pattern else 0.0))
    dense = build_layout(pattern_cfg, mc).dense
    report = {**header(), "model": mc.name, "model_identity": identity(mc), "backend": "torch", "dtype": cfg.dtype,
              "settings": asdict(cfg) | {"grid": cfg.grid(), "methods": cfg.methods()},
              "prompts": len(cases), "observations": {ctx: rec.counts[ctx].tolist() for ctx in sorted(rec.counts)},
              "dense_heads": dense, "engine_stats_max_abs_gap": rec.stats_gap,
              **summarize(rec, cfg, dense)}
    report["table"] = table_lines(report)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(out_dir)
    write_json(out / f"{name}.json", report)
    from lserve.bench.selection_mass_plot import plot_mass_by_layer

    plot_mass_by_layer(report, out / f"{name}.png")
    print("\n".join(report["table"]))
    print(f"wrote {out / name}.json and .png ({report['seconds']} s)")
    return report
