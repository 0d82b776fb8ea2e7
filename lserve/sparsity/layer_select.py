"""Which layers use dynamic page selection (``SparsityConfig.select_layers``).

On a small model the min/max selector keeps nearly all of the attention mass in some layers
and drops a third of it in others, where attention is diffuse (``benchmarks/accuracy/accuracy_notes.md``).
``lserve calibrate-selection`` (:mod:`lserve.calibration.selection`) measures, per layer, the mass
the selected pages hold and writes a calibration JSON; here a ``select_layers`` setting becomes
one flag per layer. In layers without selection dense heads read every page, exactly as below
the dynamic threshold.
"""

from __future__ import annotations

from pathlib import Path

from lserve.config import ConfigError, ModelConfig
from lserve.sparsity.calibration_file import read_calibration

CALIBRATION_NAME = "selection_layers.json"
CALIBRATION_KIND = "selection-layers"


def default_calibration_for(model: ModelConfig) -> Path | None:
    """The calibration shipped for this model (found by its identity,
    :func:`lserve.sparsity.shipped.shipped_folder`), or None."""
    from lserve.sparsity.shipped import shipped_folder

    folder = shipped_folder(model)
    path = folder / CALIBRATION_NAME if folder is not None else None
    return path if path is not None and path.is_file() else None


def load_calibration(path: str | Path) -> dict:
    """Read a calibration written by :func:`lserve.calibration.selection.calibrate_selection`."""
    return read_calibration(path, CALIBRATION_KIND, "selection calibration", "a selection calibration",
                            "lserve calibrate-selection", "select_layers")


def resolve_select_layers(spec: str | tuple[int, ...], model: ModelConfig) -> tuple[bool, ...]:
    """One flag per layer: does this layer select pages?

    Parameters
    ----------
    spec : str or tuple of int
        ``SparsityConfig.select_layers`` (already normalised by the config).
    model : ModelConfig
        The model; its identity finds the shipped calibration for ``"auto"``.

    Raises
    ------
    ConfigError
        If the indices or the calibration do not fit the model's layer count.
    """
    n = model.num_layers
    source = None
    if spec == "auto":
        source = default_calibration_for(model)
        if source is None:  # no calibration for this model: the paper's behaviour
            return (True,) * n
    elif spec in ("all", "none"):
        return (spec == "all",) * n
    elif isinstance(spec, str):
        source = Path(spec)
    if source is not None:
        data = load_calibration(source)
        if data.get("num_layers") != n:
            raise ConfigError(f"selection calibration {source} is for {data.get('num_layers')} layers "
                              f"({data.get('model')}) but the model {model.name} has {n}")
        spec = tuple(data["select_layers"])
    bad = [i for i in spec if not 0 <= i < n]
    if bad:
        raise ConfigError(f"select_layers names layer {bad[0]} but the model has {n} layers (0..{n - 1})")
    chosen = set(spec)
    return tuple(i in chosen for i in range(n))
