"""The head patterns that ship with LServe, by model (looked up by the engine, not trained here:
the DuoAttention-style trainer is :mod:`lserve.sparsity.classifier`)."""

from __future__ import annotations

import re
from pathlib import Path

from lserve.config import ConfigError

PATTERN_ROOT = Path(__file__).resolve().parent.parent / "patterns"
# Normalized model-name fragment -> folder under lserve/patterns/ with a learned pattern.
SHIPPED_PATTERNS = {"smollm2-135m": "smollm2-135m"}


def default_pattern_for(model_name: str) -> Path | None:
    """The shipped learned pattern for a model, or None if there is none.

    Parameters
    ----------
    model_name : str
        ``"default"`` (the bundled SmolLM2-135M-Instruct), or a model's name as the loader
        reports it (``ModelConfig.name``: a GGUF file stem or a Hugging Face directory name),
        or a path to such a file/directory. Matching ignores case, ``_`` vs ``-`` and the path.

    Returns
    -------
    Path or None
        A directory holding ``full_attention_heads.tsv`` and ``config.json``.
    """
    name = "smollm2-135m" if model_name == "default" else re.sub(r"[^a-z0-9.]+", "-", Path(model_name).name.lower())
    for key, folder in SHIPPED_PATTERNS.items():
        if key in name:
            path = PATTERN_ROOT / folder
            if (path / "full_attention_heads.tsv").is_file():
                return path
    return None


LEARNED_ALIASES = ("learned", "default")


def resolve_pattern(spec: str, model: str) -> str:
    """A pattern spec as ``SparsityConfig.pattern`` holds it, with ``"learned"`` made concrete.

    Parameters
    ----------
    spec : str
        ``"learned"`` (or ``"default"``): the pattern shipped for ``model``; anything else
        (a directory, a TSV, ``"random"``) is returned unchanged.
    model : str
        The engine's model spec (``"default"``, a GGUF file, a Hugging Face directory) or name.

    Raises
    ------
    ConfigError
        If ``spec`` asks for the learned pattern and none ships for ``model``.
    """
    if spec not in LEARNED_ALIASES:
        return spec
    path = default_pattern_for(model)
    if path is None:
        shipped = ", ".join(sorted(SHIPPED_PATTERNS))
        raise ConfigError(f"no learned head pattern ships for model {model!r} (shipped: {shipped}); train one with "
                          f"`lserve classify-heads --model ... --out DIR` and pass --pattern DIR")
    return str(path)
