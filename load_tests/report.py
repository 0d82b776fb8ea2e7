"""The run's report: a JSON file (command, settings, summary, per-request data) and a PNG."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from load_tests.client import RequestResult


def write_json(path: str | os.PathLike, report: dict) -> Path:
    """Write ``report`` as indented JSON (parent folders created).

    Parameters
    ----------
    path : str or PathLike
    report : dict

    Returns
    -------
    Path
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return p


def write_png(path: str | os.PathLike, results: list[RequestResult], summary: dict, title: str) -> Path | None:
    """Four panels: TTFT, TPOT and ITL distributions (CDFs, SLO lines) and latency over the run.

    Parameters
    ----------
    path : str or PathLike
    results : list of RequestResult
    summary : dict
        :func:`load_tests.stats.summarize` output (for the SLO lines and the caption).
    title : str

    Returns
    -------
    Path or None
        None (after a one-line hint on stderr) when matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:  # plots are an optional extra; the JSON is already written
        print("load_tests: install lserve[plot] for plots", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in results if r.success]
    slos = summary["goodput"]["slos_ms"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))

    def cdf(ax, values_ms, name, slo_key):
        if values_ms:
            v = np.sort(np.asarray(values_ms))
            ax.plot(v, np.arange(1, v.size + 1) / v.size, drawstyle="steps-post")
            for p, style in ((50, ":"), (90, "--"), (99, "-.")):
                ax.axvline(np.percentile(v, p), color="grey", linestyle=style, linewidth=0.8, label=f"p{p}")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        if slo_key in slos:
            ax.axvline(slos[slo_key], color="red", linewidth=1.2, label=f"SLO {slos[slo_key]:g} ms")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("tokens" if slo_key == "itl" else "requests"))
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")

    cdf(axes[0, 0], [r.ttft * 1e3 for r in ok], "TTFT", "ttft")
    cdf(axes[0, 1], [r.tpot * 1e3 for r in ok if r.tpot is not None], "TPOT", "tpot")
    cdf(axes[1, 0], [x * 1e3 for r in ok for x in r.itl], "ITL", "itl")
    ax = axes[1, 1]
    if ok:
        ax.scatter([r.start for r in ok], [r.e2e * 1e3 for r in ok], s=12, label="E2E")
        ax.scatter([r.start for r in ok], [r.ttft * 1e3 for r in ok], s=12, marker="x", label="TTFT")
    bad = [r for r in results if not r.success]
    if bad:
        ax.scatter([r.start for r in bad], [0] * len(bad), s=20, color="red", marker="v", label="failed")
    ax.set_xlabel("send time (s from start)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("latency over the run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    s = summary
    caption = (f"{s['successful']} ok / {s['failed']} failed in {s['duration_s']:.1f} s   "
               f"{s['request_throughput']:.2f} req/s   {s['output_token_throughput']:.1f} out tok/s   "
               f"goodput {s['goodput']['goodput_rps']:.2f} req/s ({s['goodput']['good_requests']} good)")
    if "answers" in s:
        caption += f"   answers {s['answers']['correct']}/{s['answers']['checked']}"
    fig.suptitle(f"{title}\n{caption}", fontsize=10)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return p
