"""Per-layer decode token budgets calibrated offline from the mass curves (``lserve calibrate-budgets``).

``lserve bench selection-mass`` measures, per layer and dense KV head, the attention mass the
upper-bound selector keeps at a grid of budgets. Here a *mean* budget B is split across the
layers that have dense heads so that the attention mass of the worst layer is as high as the
mean allows:

1. the largest target t such that giving every layer the smallest grid budget keeping mass >= t
   (its whole context when no grid budget does) costs at most B per dense head on average
   (layers weighted by their dense heads: bytes read are per head);
2. what is left of the mean is spent greedily on the steps with the largest mass gain per token.

The result is stored as per-layer *ratios* r_l = b_l / B (dense-head-weighted mean 1), which
:mod:`lserve.sparsity.adaptive_budget` reads and applies at run time.
"""

from __future__ import annotations

from lserve.config import ConfigError
from lserve.sparsity.adaptive_budget import ADAPTIVE_KIND


def _smallest_keeping(curve: list[tuple[int, float]], target: float, full: int) -> tuple[int, float]:
    """(budget, mass) of the smallest grid budget whose mass reaches ``target``; else (full, 1)."""
    for b, m in curve:
        if m >= target:
            return b, m
    return full, 1.0


def allocate(curves: dict[int, list[tuple[int, float]]], weights: dict[int, int], mean_budget: int,
             full: int) -> dict[int, int]:
    """Per-layer budgets with a dense-head-weighted mean of at most ``mean_budget``.

    Parameters
    ----------
    curves : dict
        layer -> [(budget, mass kept)] ascending in budget (mass non-decreasing).
    weights : dict
        layer -> dense heads of that layer (> 0).
    mean_budget : int
        The mean the allocation may spend per dense head.
    full : int
        The context length: the budget of a layer that reads everything (mass 1).

    Returns
    -------
    dict
        layer -> tokens. If even the smallest grid budgets exceed the mean, every layer gets
        its smallest one (the caller's mean is then not met; :func:`calibrate_budgets` reports it).
    """
    total_w = sum(weights.values())
    cap = mean_budget * total_w

    def cost(alloc: dict[int, int]) -> int:
        return sum(weights[layer] * b for layer, b in alloc.items())

    masses = sorted({m for c in curves.values() for _, m in c} | {1.0})
    lo = {layer: _smallest_keeping(c, 0.0, full)[0] for layer, c in curves.items()}
    best = lo
    for t in masses:  # the largest feasible target (cost grows with t)
        alloc = {layer: _smallest_keeping(c, t, full)[0] for layer, c in curves.items()}
        if cost(alloc) > cap:
            break
        best = alloc
    # Spend what is left on the best mass gain per token (steps along each layer's grid, then "all").
    alloc = dict(best)
    while True:
        left = cap - cost(alloc)
        options = []
        for layer, c in curves.items():
            steps = [(b, m) for b, m in c if b > alloc[layer]] + [(full, 1.0)]
            now = dict(c).get(alloc[layer], 1.0 if alloc[layer] >= full else 0.0)
            for b, m in steps:
                extra = weights[layer] * (b - alloc[layer])
                if 0 < extra <= left and m > now:
                    options.append(((m - now) / (b - alloc[layer]), layer, b))
        if not options:
            return alloc
        _, layer, b = max(options)
        alloc[layer] = b


def calibrate_budgets(mass_report: dict, context: int, mean_budget: int, method: str = "bound_p64_l16") -> dict:
    """Per-layer budget ratios from a ``lserve bench selection-mass`` report.

    Parameters
    ----------
    mass_report : dict
        The report's JSON (``layers[context][method][budget]``: per-layer mean mass over the
        dense heads of the learned pattern, None for layers without any).
    context : int
        Which of the report's contexts to calibrate at.
    mean_budget : int
        The mean budget the ratios are computed for (ratios are applied to any mean at run time).

    Returns
    -------
    dict
        ``kind``, ``model``, ``ratios`` ([L] ratio per layer, None for layers without dense
        heads), ``budgets`` ([L] tokens at ``mean_budget``), ``mass`` ([L] the curve's mass at
        that budget), ``min_mass``, ``mean`` (the weighted mean budget reached) and the settings.
    """
    layers = mass_report["layers"].get(str(context), mass_report["layers"].get(context))
    if layers is None or method not in layers:
        raise ConfigError(f"the selection-mass report has no {method!r} curves at context {context} "
                          f"(contexts: {list(mass_report['layers'])})")
    by_budget = {int(b): vals for b, vals in layers[method].items()}
    dense = mass_report["dense_heads"]
    grid = sorted(b for b in by_budget if b < context)
    curves = {layer: [(b, by_budget[b][layer]) for b in grid] for layer, heads in enumerate(dense)
              if heads and by_budget[grid[0]][layer] is not None}
    weights = {layer: len(dense[layer]) for layer in curves}
    alloc = allocate(curves, weights, mean_budget, context)
    mass = {layer: dict(curves[layer]).get(b, 1.0) for layer, b in alloc.items()}
    n = len(dense)
    mean = sum(weights[la] * b for la, b in alloc.items()) / sum(weights.values())
    return {"kind": ADAPTIVE_KIND, "model": mass_report.get("model"),
            "model_identity": mass_report.get("model_identity"), "method": method, "context": context,
            "mean_budget": mean_budget, "source": mass_report.get("command"),
            "rule": "max-min mass target under the dense-head-weighted mean budget, remainder by mass gain per token",
            "ratios": [round(alloc[la] / mean_budget, 4) if la in alloc else None for la in range(n)],
            "budgets": [alloc.get(la) for la in range(n)],
            "mass": [round(mass[la], 4) if la in mass else None for la in range(n)],
            "min_mass": round(min(mass.values()), 4) if mass else None, "mean": round(mean, 1)}
