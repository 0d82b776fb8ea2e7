"""The plot of ``lserve bench selection-mass``: attention mass kept vs layer, one panel per
(context, budget), one line per method."""

from __future__ import annotations

from pathlib import Path

from lserve.plotting import pyplot

# Line colour by physical page size; solid: bound with logical page 16, dashed: logical page 8,
# dotted: oracle at that page size; black: token oracle.
COLOURS = {16: "tab:green", 32: "tab:orange", 64: "tab:blue"}


def _style(method: str) -> dict:
    if method == "oracle_token":
        return {"color": "black", "ls": "-", "lw": 1.0}
    parts = method.split("_")
    colour = COLOURS.get(int(parts[1][1:]), "tab:gray")
    if parts[0] == "oracle":
        return {"color": colour, "ls": ":", "lw": 1.6}
    return {"color": colour, "ls": "-" if parts[2] == "l16" else "--", "lw": 1.2}


def plot_mass_by_layer(report: dict, path: str | Path) -> None:
    """Write the PNG: rows = contexts, columns = the table's budgets."""
    plt = pyplot()
    if plt is None:
        return

    budgets = report["settings"]["budgets"]
    contexts = list(report["layers"])
    fig, axes = plt.subplots(len(contexts), len(budgets), figsize=(4 * len(budgets), 3.2 * len(contexts)),
                             sharex=True, sharey=True, squeeze=False)
    for r, ctx in enumerate(contexts):
        for c, b in enumerate(budgets):
            ax = axes[r][c]
            for m, by_budget in report["layers"][ctx].items():
                ys = by_budget[b]
                xs = [i for i, y in enumerate(ys) if y is not None]
                ax.plot(xs, [ys[i] for i in xs], marker=".", ms=3, label=m, **_style(m))
            ax.set_title(f"context {ctx}, budget {b}", fontsize=9)
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            if r == len(contexts) - 1:
                ax.set_xlabel("layer")
            if c == 0:
                ax.set_ylabel("attention mass kept")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8)
    fig.suptitle(f"{report.get('model', '')}: decode attention mass kept per layer (mean over dense heads)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
