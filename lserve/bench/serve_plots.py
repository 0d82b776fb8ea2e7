"""Plots of ``lserve bench serve`` reports: tokens/s per concurrency, and the ITL SLO trade-off curve."""

from __future__ import annotations

import itertools
from pathlib import Path

from lserve.plotting import pyplot


def sweep_curve(report: dict) -> list[dict]:
    """The rows of the ITL SLO trade-off: the sweep's, and the plan's rows of the same (workload,
    context, concurrency, output, stream interval) at an SLO the sweep did not serve for their
    configuration; rows without a TTFT or ITL p99 left out."""
    sweep = report.get("itl_sweep") or []

    def point(r: dict) -> tuple:
        return r.get("workload"), r["context"], r["concurrency"], r["output_len"], r.get("stream_interval", 1)

    points = {point(r) for r in sweep}
    served = {(r["config"], r["itl_slo_ms"]) for r in sweep}
    plan = [r for r in report["rows"] if point(r) in points
            and (r["config"], r.get("itl_slo_ms")) not in served and r.get("itl_slo_ms") is not None]
    return [r for r in sweep + plan if r["ttft_p50_s"] is not None and r["itl_p99_ms"] is not None]


def plot_itl_sweep(report: dict, path: Path) -> None:
    """TTFT p50 against ITL p99 of the ITL SLO sweep, one line per configuration, each point
    labelled with its ``--itl-slo-ms`` (0: none); with it the plan's rows at the sweep's point
    (served at the default SLO)."""
    plt = pyplot()
    rows = sweep_curve(report)
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for config, style in (("lserve", "o-"), ("lserve-sparse", "^-"), ("dense", "s--")):
        rs = sorted((r for r in rows if r["config"] == config), key=lambda r: r["itl_p99_ms"])
        if not rs:
            continue
        ax.plot([r["itl_p99_ms"] for r in rs], [r["ttft_p50_s"] for r in rs], style, label=config)
        for r in rs:
            ax.annotate(f"{r['itl_slo_ms']:g}", (r["itl_p99_ms"], r["ttft_p50_s"]), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
    r0 = rows[0]
    ax.set_title(f"{r0.get('workload')} {r0['context']} in / {r0['output_len']} out, C={r0['concurrency']}: "
                 "--itl-slo-ms sweep", fontsize=9)
    ax.set_xlabel("ITL p99 (ms)")
    ax.set_ylabel("TTFT p50 (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_serve(report: dict, path: Path) -> None:
    """Output tokens/s vs concurrency per context, and TTFT/ITL p50 per point, LServe beside dense."""
    plt = pyplot()
    if plt is None:
        return

    rows = report["rows"]
    if not rows:
        return
    def key(r):
        return r.get("workload", "random"), r["context"], r["output_len"]

    panels = sorted({key(r) for r in rows}, key=lambda k: (k[1], k[2], k[0]))
    intervals = sorted({r.get("stream_interval", 1) for r in rows})
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7), squeeze=False)
    for j, panel in enumerate(panels):
        for (config, style), si in itertools.product((("lserve", "o-"), ("lserve-sparse", "^-"), ("dense", "s--")),
                                                     intervals):
            rs = sorted((r for r in rows if key(r) == panel and r["config"] == config
                         and r.get("stream_interval", 1) == si), key=lambda r: r["concurrency"])
            if not rs:
                continue
            if len(intervals) > 1:  # one line per --stream-interval, told apart by its label and line
                config, style = f"{config} si={si}", style if si == intervals[0] else style[0] + "-."
            cs = [r["concurrency"] for r in rs]
            axes[0][j].plot(cs, [r["output_tok_s"] for r in rs], style, label=config)
            bound = [(r["concurrency"], r["bound_tok_s"]) for r in rs if r.get("bound_tok_s")]
            if bound:
                axes[0][j].plot(*zip(*bound), style[0] + ":", alpha=0.4, label=f"{config} bound")
            axes[1][j].plot(cs, [r["itl_p50_ms"] or 0 for r in rs], style, label=f"{config} ITL p50")
            axes[1][j].plot(cs, [r["itl_p99_ms"] or 0 for r in rs], style, alpha=0.4, label=f"{config} ITL p99")
        axes[0][j].set_title(f"{panel[0]}: {panel[1]} in / {panel[2]} out", fontsize=9)
        axes[0][j].set_xlabel("concurrency")
        axes[0][j].set_ylabel("output tokens/s")
        axes[1][j].set_xlabel("concurrency")
        axes[1][j].set_ylabel("ms")
        axes[0][j].legend(fontsize=8)
        axes[1][j].legend(fontsize=7)
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
    fig.suptitle(f"served {report.get('model')} on {report.get('device')} ({report.get('date')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
