"""Where dynamic page selection starts to pay: profiled per (device, model shape).

Below some context length the selector (scoring every page, top-k) costs more than the pages
it lets the dense heads skip (SPEC.md section 4). ``lserve bench profile-threshold`` measures
that length on the current device (the sweep is read by :mod:`lserve.calibration.threshold_sweep`)
and writes it here; engines whose ``dynamic_threshold`` is ``-1`` ("auto") look it up at start-up.

The threshold is stored as a ratio of context to token budget (selection pays once the context
is ``ratio`` times the budget), so one profile serves every budget, per-request ones included.

Lookup order: the user's profile file (``$LSERVE_THRESHOLD_FILE``, default
``$LSERVE_CACHE_DIR/dynamic_threshold.json``), then the profiles shipped in
``lserve/profiles/dynamic_threshold.json``. No entry: ratio 0 (select whenever the context
exceeds the budget).

Block-sparse prefill has a profile of the same shape (kind :data:`PREFILL`, written by
``lserve bench profile-prefill-threshold``, env ``LSERVE_PREFILL_THRESHOLD_FILE``): the prompt
length from which it shortens the time to first token, read by engines whose
``prefill_sparsity_min_len`` is ``-1`` ("auto").
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from lserve.paths import cache_root

PROFILES = Path(__file__).resolve().parent.parent / "profiles"  # shipped: <kind>.json
DECODE, PREFILL = "dynamic_threshold", "prefill_threshold"  # profile kinds (file stems)
_ENV = {DECODE: "LSERVE_THRESHOLD_FILE", PREFILL: "LSERVE_PREFILL_THRESHOLD_FILE"}


def user_file(kind: str = DECODE) -> Path:
    """The profile file of ``kind`` that the profiling bench writes and engines read first."""
    env = os.environ.get(_ENV[kind])
    return Path(env) if env else cache_root() / f"{kind}.json"


def device_name(device: str) -> str:
    """A stable name for the device kind: the GPU's name, or ``cpu``."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def profile_key(device: str, model_cfg, dtype) -> str:
    """Key of a profile: device kind + the shape that decides attention cost (not the weights)."""
    c = model_cfg
    dt = str(dtype).replace("torch.", "")
    return f"{device_name(device)}|L{c.num_layers}-H{c.num_heads}-KV{c.num_kv_heads}-D{c.head_dim}-{dt}"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def lookup(key: str, kind: str, field: str) -> tuple[float, str] | None:
    """(``field`` of the profile for ``key``, source file), user file first; None if unprofiled."""
    for path in (user_file(kind), PROFILES / f"{kind}.json"):
        entry = _read(path).get(key)
        if entry is not None and entry.get(field) is not None:
            return float(entry[field]), str(path)
    return None


def lookup_ratio(key: str) -> tuple[float, str] | None:
    """(ratio, source file) of the decode-selection profile for ``key``; None if unprofiled."""
    return lookup(key, DECODE, "ratio")


def save_profile(key: str, entry: dict, path: Path | None = None, kind: str = DECODE) -> Path:
    """Merge ``entry`` under ``key`` into the profile file (default: the user's of ``kind``); returns its path."""
    path = Path(path) if path is not None else user_file(kind)
    data = _read(path)
    data[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def threshold_tokens(ratio: float, budget: int) -> int:
    """Context length (tokens) from which selection runs for a given budget."""
    return math.ceil(ratio * budget)
