"""The head patterns and calibrations that ship with LServe, found by what the model is.

Each folder under ``lserve/patterns/`` holds a ``model.json`` with the identity of the model it
was trained on (:func:`lserve.identity.identity`: family, shapes and a fingerprint of the
weights); a model gets the folder whose identity equals its own, whatever its file or directory
is called. The DuoAttention-style trainer is :mod:`lserve.calibration.classifier`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from lserve.config import ConfigError, ModelConfig
from lserve.identity import identity

log = logging.getLogger("lserve")

PATTERN_ROOT = Path(__file__).resolve().parent.parent / "patterns"
IDENTITY_NAME = "model.json"
PATTERN_FILE = "full_attention_heads.tsv"


def _identity_of(model: ModelConfig | dict) -> dict:
    return identity(model) if isinstance(model, ModelConfig) else dict(model)


def shipped_folders() -> dict[str, dict]:
    """Folder name -> the model identity it was calibrated on, for every shipped folder."""
    out = {}
    for f in sorted(PATTERN_ROOT.glob(f"*/{IDENTITY_NAME}")):
        out[f.parent.name] = json.loads(f.read_text())["identity"]
    return out


def shipped_folder(model: ModelConfig | dict) -> Path | None:
    """The shipped folder calibrated on exactly this model, or None.

    Parameters
    ----------
    model : ModelConfig or dict
        A loaded model's config (its ``fingerprint`` set by the loader), or an identity dict as
        :func:`lserve.identity.identity` gives it (reports carry one).
    """
    ident = _identity_of(model)
    if not ident.get("fingerprint"):
        return None
    for name, known in shipped_folders().items():
        if known == ident:
            return PATTERN_ROOT / name
    return None


def default_pattern_for(model: ModelConfig | dict) -> Path | None:
    """The shipped learned head pattern of this model (a folder holding
    ``full_attention_heads.tsv`` and ``config.json``), or None if none ships for it."""
    folder = shipped_folder(model)
    return folder if folder is not None and (folder / PATTERN_FILE).is_file() else None


def auto_pattern(model: ModelConfig) -> Path | None:
    """:func:`default_pattern_for`, logging what ``pattern auto`` resolved to: the folder, or that
    none ships for this model so every head stays dense."""
    folder = default_pattern_for(model)
    if folder is None:
        log.info("pattern auto: no shipped head pattern for model %r (%s, %d layers x %d KV heads, fingerprint "
                    "%s): no streaming heads; train one with `lserve classify-heads`", model.name, model.architecture,
                    model.num_layers, model.num_kv_heads, model.fingerprint)
    else:
        log.info("pattern auto: the shipped pattern %s for model %r", folder.name, model.name)
    return folder


LEARNED_ALIASES = ("learned", "default")


def resolve_pattern(spec: str, model: ModelConfig) -> str:
    """A pattern spec as ``SparsityConfig.pattern`` holds it, with ``"learned"`` made concrete.

    Parameters
    ----------
    spec : str
        ``"learned"`` (or ``"default"``): the pattern shipped for ``model``; anything else
        (a directory, a TSV, ``"random"``) is returned unchanged.
    model : ModelConfig
        The loaded model.

    Raises
    ------
    ConfigError
        If ``spec`` asks for the learned pattern and none ships for ``model``.
    """
    if spec not in LEARNED_ALIASES:
        return spec
    path = default_pattern_for(model)
    if path is None:
        shipped = ", ".join(shipped_folders())
        raise ConfigError(f"no learned head pattern ships for model {model.name!r} (shipped: {shipped}, each for one "
                          f"model's weights); train one with `lserve classify-heads --model ... --out DIR` and "
                          f"pass --pattern DIR")
    return str(path)

