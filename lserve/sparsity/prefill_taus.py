"""Per-layer thresholds of block-sparse prefill (``prefill_sparsity`` "auto"): where the shipped
calibration lives, how it is read and checked against the model. Written by ``lserve
calibrate-prefill`` (:mod:`lserve.calibration.prefill`)."""

from __future__ import annotations

from pathlib import Path

from lserve.config import ConfigError, ModelConfig
from lserve.sparsity.calibration_file import read_calibration

CALIBRATION_NAME = "prefill_taus.json"
CALIBRATION_KIND = "prefill-taus"
TAU_GRID = (0.5, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999, 1.0)


def default_calibration_for(model: ModelConfig) -> Path | None:
    """The calibration shipped for this model (found by its identity,
    :func:`lserve.sparsity.shipped.shipped_folder`), or None."""
    from lserve.sparsity.shipped import shipped_folder

    folder = shipped_folder(model)
    path = folder / CALIBRATION_NAME if folder is not None else None
    return path if path is not None and path.is_file() else None


def load_layer_taus(path: str | Path, num_layers: int, num_kv_heads: int) -> tuple[float, ...]:
    """Per-layer taus of a calibration file, checked against the model's shape."""
    p = Path(path)
    data = read_calibration(p, CALIBRATION_KIND, "prefill calibration", "a prefill calibration",
                            "lserve calibrate-prefill", "layer_taus")
    if data.get("num_layers") != num_layers or data.get("num_kv_heads") != num_kv_heads:
        raise ConfigError(f"prefill calibration {p} is for {data.get('num_layers')} layers x {data.get('num_kv_heads')} "
                          f"KV heads ({data.get('model')}) but the model has {num_layers} x {num_kv_heads}")
    taus = tuple(float(t) for t in data["layer_taus"])
    if len(taus) != num_layers or not all(0.0 <= t <= 1.0 for t in taus):
        raise ConfigError(f"prefill calibration {p}: layer_taus must be {num_layers} values in [0, 1]")
    return taus


def resolve_layer_taus(spec: float, model: ModelConfig) -> tuple[tuple[float, ...] | None, str | None]:
    """``SparsityConfig.prefill_sparsity`` -> (per-layer taus or None, the file they came from).

    Only "auto" (-1) reads a calibration: the one shipped for ``model_name``; without one the
    result is (None, None) and prefill sparsity stays off for requests that do not set a tau.
    """
    if spec >= 0:
        return None, None
    path = default_calibration_for(model)
    if path is None:
        return None, None
    return load_layer_taus(path, model.num_layers, model.num_kv_heads), str(path)
