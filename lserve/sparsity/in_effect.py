"""The sparsity an engine runs, in words, for ``describe()``, ``/v1/models`` and the start-up line
of ``lserve serve`` (which prints the ``summary`` that ``/v1/models`` shows, so the two agree)."""

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
    if sp.prefill_sparsity != 0 and sp.prefill_sparsity_min_len > 0:
        prefill += f" from {sp.prefill_sparsity_min_len} tokens"
    facts = {"shipped": folder.name if folder is not None else None, "pattern": pattern,
             "streaming_fraction": round(streaming_fraction, 4), "token_budget": sp.token_budget,
             "select_layers": layers, "adaptive_budgets": budgets, "prefill_sparsity": prefill}
    return {**facts, "summary": summary(facts)}


def summary(facts: dict) -> str:
    """One line of :func:`in_effect`'s facts: head pattern and streaming fraction, decode budgets
    (off, uniform, or adaptive around their mean) and which layers select, prefill sparsity.

    Examples
    --------
    ``pattern shipped:smollm2-135m (0.5 of KV heads streaming); decode budgets adaptive
    (shipped:smollm2-135m), mean 2048 tokens, selecting layers all; prefill sparsity off``
    """
    head = f"pattern {facts['pattern']} ({facts['streaming_fraction']:g} of KV heads streaming)"
    budgets, mean = facts["adaptive_budgets"], facts["token_budget"]
    if mean <= 0:
        decode = "decode page selection off (token budget 0)"
    elif budgets.startswith("off"):
        decode = f"decode budget uniform {mean} tokens, selecting layers {facts['select_layers']}"
    else:
        decode = f"decode budgets adaptive ({budgets}), mean {mean} tokens, selecting layers {facts['select_layers']}"
    prefill = facts["prefill_sparsity"]
    if prefill.startswith("shipped:"):
        prefill = f"on, per-layer taus {prefill}"
    elif prefill.startswith("tau"):
        prefill = f"on, {prefill}"
    return f"{head}; {decode}; prefill sparsity {prefill}"
