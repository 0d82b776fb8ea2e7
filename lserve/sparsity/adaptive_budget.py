"""Per-layer decode token budgets at run time: the calibration's ratios, read and applied.

``lserve calibrate-budgets`` (:mod:`lserve.calibration.budgets`) splits a mean budget across
the layers from the selection-mass curves and stores per-layer *ratios* r_l = b_l / B
(dense-head-weighted mean 1), so at run time ``--token-budget`` (or a request's
``token_budget``) stays the mean budget: layer l reads ``r_l * budget`` tokens, rounded down to
whole pages (at least one page); a layer whose budget covers the context reads every page.
"""

from __future__ import annotations

from pathlib import Path

from lserve.config import ConfigError, ModelConfig
from lserve.sparsity.calibration_file import read_calibration

ADAPTIVE_NAME = "adaptive_budgets.json"
ADAPTIVE_KIND = "adaptive-budgets"


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
