"""Reading the calibration JSONs the ``lserve calibrate-*`` commands write (one rule for all)."""

from __future__ import annotations

import json
from pathlib import Path

from lserve.config import ConfigError


def read_calibration(path: str | Path, kind: str, name: str, what: str, command: str, key: str | None = None) -> dict:
    """The JSON object at ``path``, checked to be a calibration of ``kind`` (holding ``key``).

    Parameters
    ----------
    name, what, command : str
        Wording of the errors: "cannot read {name} PATH: ..." and "PATH is not {what} (written by
        `{command}`)".

    Raises
    ------
    ConfigError
        If the file cannot be read or parsed, or is another kind of file.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {name} {p}: {e}") from None
    if not isinstance(data, dict) or data.get("kind") != kind or (key is not None and key not in data):
        raise ConfigError(f"{p} is not {what} (written by `{command}`)")
    return data
