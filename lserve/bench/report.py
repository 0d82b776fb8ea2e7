"""Benchmark reports: JSON with the command, device and date inside, plus a PNG."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import shlex
import sys
from pathlib import Path


def device_name() -> str:
    """GPU name when CUDA is present, else the CPU model and core count."""
    import os

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} ({os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads)"


def header() -> dict:
    """The fields every benchmark JSON starts with."""
    import os

    prog = Path(sys.argv[0]).name
    prog = "lserve" if prog in ("__main__.py", "lserve") else prog  # python -m lserve ... is the lserve CLI
    command = " ".join(shlex.quote(a) for a in [prog, *sys.argv[1:]])
    # a wrapper script names itself (scripts/gpu_run.sh sets it around the module it runs)
    command = os.environ.get("LSERVE_BENCH_COMMAND", command)
    return {"command": command,
            "device": device_name(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            # Other work on the machine skews CPU timings: keep the load next to the numbers.
            "load_average_1m": round(os.getloadavg()[0], 2)}


def write_json(path: str | Path, report: dict) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report, indent=2) + "\n")
    return p


def write_labelled_run(path: str | Path, probe: str, geometry: dict, label: str, run: dict) -> Path:
    """Add ``run`` as ``runs[label]`` of the JSON report at ``path`` (kept: its other labels), with
    the probe's name and geometry, so one command before and after a change leaves both runs."""
    p = Path(path)
    report = json.loads(p.read_text()) if p.exists() else {}
    report.update({"probe": probe, "machine": "CPU", "geometry": geometry})
    report.setdefault("runs", {})[label] = run
    return write_json(p, report)

