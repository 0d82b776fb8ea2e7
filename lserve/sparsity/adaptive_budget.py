"""Per-layer decode token budgets calibrated offline from the mass curves (issue 21, part 2).

``lserve bench selection-mass`` measures, per layer and dense KV head, the attention mass the
upper-bound selector keeps at a grid of budgets. Here a *mean* budget B is split across the
layers that have dense heads so that the attention mass of the worst layer is as high as the
mean allows:

1. the largest target t such that giving every layer the smallest grid budget keeping mass >= t
   (its whole context when no grid budget does) costs at most B per dense head on average
   (layers weighted by their dense heads: bytes read are per head);
2. what is left of the mean is spent greedily on the steps with the largest mass gain per token.

The result is stored as per-layer *ratios* r_l = b_l / B (dense-head-weighted mean 1), so at
run time ``--token-budget`` (or a request's ``token_budget``) stays the mean budget: layer l
reads ``r_l * budget`` tokens, rounded down to whole pages (at least one page); a layer whose
budget covers the context reads every page.
"""

from __future__ import annotations

from pathlib import Path

from lserve.config import ConfigError, ModelConfig
from lserve.sparsity.calibration_file import read_calibration

ADAPTIVE_NAME = "adaptive_budgets.json"
ADAPTIVE_KIND = "adaptive-budgets"


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


def load_ratios(path: str | Path, num_layers: int) -> tuple[float | None, ...]:
    """Per-layer ratios of an adaptive-budget calibration (None: no dense heads there).

    Raises
    ------
    ConfigError
        If the file is not such a calibration or is for another layer count.
    """
    p = Path(path)
    data = read_calibration(p, ADAPTIVE_KIND, "adaptive budgets", "an adaptive-budget calibration",
                            "lserve calibrate-budgets")
    ratios = data["ratios"]
    if len(ratios) != num_layers:
        raise ConfigError(f"adaptive budgets {p} are for {len(ratios)} layers but the model has {num_layers}")
    return tuple(None if r is None else float(r) for r in ratios)


def resolve_ratios(spec: str, model: ModelConfig) -> tuple[float | None, ...] | None:
    """``SparsityConfig.adaptive_budgets`` -> per-layer ratios, or None when off.

    ``""``/``"none"``: off; ``"auto"``: the calibration shipped for this model (found by its
    identity, :mod:`lserve.sparsity.shipped`; an error when there is none); else a calibration
    JSON path.
    """
    if spec in ("", "none"):
        return None
    if spec == "auto":
        from lserve.sparsity.shipped import shipped_folder

        folder = shipped_folder(model)
        path = folder / ADAPTIVE_NAME if folder is not None else None
        if path is None or not path.is_file():
            raise ConfigError(f"no shipped adaptive budgets for model {model.name!r} ({model.architecture}, "
                              f"{model.num_layers} layers, fingerprint {model.fingerprint}): pass a calibration JSON")
        return load_ratios(path, model.num_layers)
    return load_ratios(spec, model.num_layers)


def layer_pages(ratio: float | None, budget_pages: int, page_size: int) -> int:
    """Pages a layer keeps: ``ratio * budget`` tokens rounded down to pages, at least one
    (``ratio`` None: the mean itself)."""
    if ratio is None:
        return budget_pages
    return max(1, int(ratio * budget_pages * page_size) // page_size)


#: The calibration ``resample_calibration`` starts from by default: the default model's.
DEFAULT_RESAMPLE_SOURCE = Path(__file__).resolve().parent.parent / "patterns" / "smollm2-135m" / ADAPTIVE_NAME


def resample_ratios(ratios: list[float | None], weights: list[int]) -> list[float | None]:
    """Per-layer ratios moved to another layer count by relative depth, mean kept at 1.

    Parameters
    ----------
    ratios : list
        The source's ratios, one per layer (None where it has no dense heads: skipped, the
        neighbours' values are interpolated across it).
    weights : list of int
        Dense heads of each layer of the *target* model (its length is the target's layer
        count; layers with none get None, as in a calibration).

    Returns
    -------
    list
        Layer j of the target, at relative depth j / (L - 1), gets the source's ratios linearly
        interpolated at that depth (held flat past the source's first and last values), then
        all are scaled so that their dense-head-weighted mean is 1: the mean budget stays the
        ``--token-budget`` it is applied to.

    Raises
    ------
    ConfigError
        If the source has no ratio or the target no dense head.
    """
    import numpy as np

    known = [(i, r) for i, r in enumerate(ratios) if r is not None]
    if not known or not any(weights):
        raise ConfigError("cannot resample adaptive budgets: the source has no ratio or the target no dense head")
    def depth(i: int, n: int) -> float:
        return i / (n - 1) if n > 1 else 0.0

    xs = [depth(i, len(ratios)) for i, _ in known]
    raw = np.interp([depth(j, len(weights)) for j in range(len(weights))], xs, [r for _, r in known])
    w = np.asarray(weights, dtype=np.float64)
    scale = w.sum() / float((w * raw).sum())
    return [round(float(r * scale), 4) if n else None for r, n in zip(raw, weights)]


def resample_calibration(weights: list[int], source: str | Path = DEFAULT_RESAMPLE_SOURCE) -> dict:
    """An adaptive-budget record for a model with no calibration of its own: the ratios of
    ``source`` resampled to ``len(weights)`` layers (:func:`resample_ratios`).

    The record has the calibration's ``kind`` and ``ratios`` (so :func:`load_ratios` and
    ``--adaptive-budgets PATH`` take it once written) and says that it was resampled, from
    which file and how; it is not a measurement on the target model.

    Parameters
    ----------
    weights : list of int
        Dense heads per layer of the target model.
    source : str or Path
        A calibration written by ``lserve calibrate-budgets``.
    """
    p = Path(source)
    data = read_calibration(p, ADAPTIVE_KIND, "adaptive budgets", "an adaptive-budget calibration",
                            "lserve calibrate-budgets")
    ratios = resample_ratios(data["ratios"], list(weights))
    w = [n for n, r in zip(weights, ratios) if r is not None]
    mean = sum(n * r for n, r in zip(w, (r for r in ratios if r is not None))) / sum(w)
    try:  # a file of the repository is named from its root, so the record is the same on any machine
        named = str(p.resolve().relative_to(DEFAULT_RESAMPLE_SOURCE.parents[3]))
    except ValueError:
        named = str(p)
    return {"kind": ADAPTIVE_KIND, "resampled": True, "resampled_from": named, "source_model": data.get("model"),
            "source_layers": len(data["ratios"]), "layers": len(ratios), "dense_heads": list(weights),
            "rule": "source ratios linearly interpolated over relative depth (layers without dense heads "
                    "skipped), then scaled to a dense-head-weighted mean of 1",
            "ratios": ratios, "mean_ratio": round(mean, 4)}
