"""Plots of an accuracy run: NIAH depth x length heatmaps, accuracy vs budget, per configuration,
and against the decode KV bytes read."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

from lserve.plotting import pyplot


def plot_heatmaps(summary: dict, path: str | Path, task: str) -> bool:
    """One panel per configuration: accuracy by depth (rows) x context (columns) for ``task``."""
    rows = [r for r in summary["depth_rows"] if r["task"] == task]
    if not rows:
        return False
    configs = list(dict.fromkeys(r["config"] for r in rows))
    ctxs = sorted({r["context"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    cell = {(r["config"], r["context"], r["depth"]): r["accuracy"] for r in rows}
    plt = pyplot()
    ncol = min(4, len(configs))
    nrow = -(-len(configs) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(0.9 * len(ctxs) * ncol + 1.5, 0.35 * len(depths) * nrow + 1.2),
                             squeeze=False)
    im = None
    for i, name in enumerate(configs):
        ax = axes[i // ncol][i % ncol]
        grid = [[cell.get((name, c, d), float("nan")) for c in ctxs] for d in depths]
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        for y in range(len(depths)):
            for x in range(len(ctxs)):
                v = grid[y][x]
                if v == v:
                    ax.text(x, y, f"{v:.0f}", ha="center", va="center", fontsize=6)
        ax.set_title(name, fontsize=8)
        ax.set_xticks(range(len(ctxs)), [f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in ctxs], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=6)
        ax.set_xlabel("context", fontsize=7)
        ax.set_ylabel("depth", fontsize=7)
    for j in range(len(configs), nrow * ncol):
        axes[j // ncol][j % ncol].axis("off")
    fig.suptitle(f"{task}: accuracy (%) by needle depth and context length", fontsize=9)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def plot_budget(summary: dict, path: str | Path) -> bool:
    """Accuracy vs budget (as a fraction of the context) for sweep configurations ``BASE@<budget>``.

    One line per (base, context); dense accuracy is a dashed line per context, and the base
    configuration itself (e.g. ``lserve``: 1/8, at least 512) a star at its effective fraction.
    """
    rows = summary["rows"]
    sweep = [r for r in rows if "@" in r["config"]]
    if not sweep:
        return False
    tasks = sorted({r["task"] for r in sweep})
    plt = pyplot()
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        lines = sorted({(r["config"].split("@")[0], r["context"]) for r in sweep if r["task"] == task})
        for base, ctx in lines:
            pts = sorted((r["budget"] / ctx, r["accuracy"]) for r in sweep
                         if r["task"] == task and r["context"] == ctx and r["config"].split("@")[0] == base)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{base} {ctx // 1024}k")
            dense = [r for r in rows if r["config"] == "dense" and r["task"] == task and r["context"] == ctx]
            if dense:
                ax.axhline(dense[0]["accuracy"], color=line.get_color(), ls="--", lw=0.8, alpha=0.7)
            pre = [r for r in rows if r["config"] == base and r["task"] == task and r["context"] == ctx]
            if pre and pre[0]["budget"]:
                ax.plot([pre[0]["budget"] / ctx], [pre[0]["accuracy"]], "*", color=line.get_color(), ms=10)
        ax.set_xscale("log", base=2)
        fracs = sorted({Fraction(r["budget_spec"]) for r in sweep if r["task"] == task})
        ax.set_xticks([float(f) for f in fracs], [str(f) for f in fracs], fontsize=7)
        ax.set_ylim(-3, 103)
        ax.set_xlabel("decode token budget / context (clamped to >= 2 pages)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(f"{task} (dashed: dense; star: base config)", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_bars(summary: dict, path: str | Path) -> bool:
    """Accuracy per configuration, one group per (task, context)."""
    rows = [r for r in summary["rows"] if "@" not in r["config"]]
    if not rows:
        return False
    groups = list(dict.fromkeys((r["task"], r["context"]) for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    val = {(r["config"], r["task"], r["context"]): r["accuracy"] for r in rows}
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(groups) * len(configs) / 2), 3.6))
    w = 0.8 / len(configs)
    for i, c in enumerate(configs):
        xs = [g + (i - (len(configs) - 1) / 2) * w for g in range(len(groups))]
        ax.bar(xs, [val.get((c, t, x), 0) for t, x in groups], w, label=c)
    ax.set_xticks(range(len(groups)), [f"{t}\n{x // 1024}k" for t, x in groups], fontsize=7)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_bytes(summary: dict, path: str | Path) -> bool:
    """Accuracy against the share of dense attention's decode KV bytes read, one panel per task:
    a point per (configuration, context), one marker per configuration, labelled with the context."""
    rows = [r for r in summary["rows"] if r.get("kv_read_fraction") is not None and "@" not in r["config"]]
    if not rows:
        return False
    tasks = sorted({r["task"] for r in rows})
    configs = list(dict.fromkeys(r["config"] for r in rows))
    plt = pyplot()
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, c in enumerate(configs):
            pts = sorted((r["kv_read_fraction"], r["accuracy"], r["context"]) for r in rows
                         if r["task"] == task and r["config"] == c)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "osD^v*"[i % 6], label=c, alpha=0.8)
            for x, y, ctx in pts:
                ax.annotate(f"{ctx // 1024}k", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_ylim(-3, 103)
        ax.set_xlabel("decode KV bytes read / dense")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(task, fontsize=8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_all(summary: dict, out: str) -> list[str]:
    """Every plot the summary supports; returns the written paths (none without matplotlib)."""
    written = []
    if pyplot() is None:
        return written
    for task in sorted({r["task"] for r in summary["depth_rows"]}):
        p = f"{out}_heatmap_{task}.png"
        if plot_heatmaps(summary, p, task):
            written.append(p)
    if plot_budget(summary, f"{out}_budget.png"):
        written.append(f"{out}_budget.png")
    if plot_bars(summary, f"{out}_configs.png"):
        written.append(f"{out}_configs.png")
    if plot_bytes(summary, f"{out}_bytes.png"):
        written.append(f"{out}_bytes.png")
    return written
