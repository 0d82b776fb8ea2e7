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
