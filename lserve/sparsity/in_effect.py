"""The sparsity an engine runs, in words, for ``describe()`` and ``/v1/models``."""

from __future__ import annotations

from lserve.config import ModelConfig, SparsityConfig
from lserve.sparsity.adaptive_budget import ADAPTIVE_NAME
from lserve.sparsity.layer_select import CALIBRATION_NAME
from lserve.sparsity.prefill_taus import CALIBRATION_NAME as PREFILL_TAUS_NAME
from lserve.sparsity.shipped import PATTERN_FILE, shipped_folder


def in_effect(sp: SparsityConfig, model: ModelConfig, streaming_fraction: float) -> dict:
    """The sparsity an engine with settings ``sp`` runs on ``model``, in words (``describe()``
    and ``/v1/models`` show it): where ``auto`` found a shipped calibration and where it did not.
    """
    folder = shipped_folder(model)

    def ships(name: str) -> bool:
        return folder is not None and (folder / name).is_file()

    missing = "auto: none ships for this model"
    if sp.pattern == "auto":
        pattern = (f"shipped:{folder.name}" if ships(PATTERN_FILE) else f"none ({missing})")
    else:
        pattern = sp.pattern or "none"
    if not sp.streaming_enabled():
        pattern = "none"
    layers = sp.select_layers
    if layers == "auto":
        layers = f"shipped:{folder.name}" if ships(CALIBRATION_NAME) else f"all ({missing})"
    elif isinstance(layers, tuple):
        layers = ",".join(map(str, layers))
    budgets = sp.adaptive_budgets or "off"
    if budgets == "auto":
        budgets = f"shipped:{folder.name}" if ships(ADAPTIVE_NAME) else f"off ({missing})"
    if sp.prefill_sparsity >= 0:
        prefill = f"tau {sp.prefill_sparsity:g}" if sp.prefill_sparsity > 0 else "off"
    else:
        prefill = f"shipped:{folder.name}" if ships(PREFILL_TAUS_NAME) else f"off ({missing})"
    return {"shipped": folder.name if folder is not None else None, "pattern": pattern,
            "streaming_fraction": round(streaming_fraction, 4), "token_budget": sp.token_budget,
            "select_layers": layers, "adaptive_budgets": budgets, "prefill_sparsity": prefill}
