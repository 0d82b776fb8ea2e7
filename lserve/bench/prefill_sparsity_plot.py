"""The plots of ``lserve bench prefill-sparsity``: kept tile fraction and true mass kept per layer
and KV head (one estimator and tau), and kept fraction / mass per layer for every estimator and tau."""

from __future__ import annotations

from pathlib import Path

from lserve.plotting import pyplot

COLOURS = {"antidiagonal": "tab:blue", "bound": "tab:orange", "oracle": "black"}
HEAD_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray")


def _by_layer(report: dict, ctx: int, tau: float, est: str) -> list[dict]:
    """The rows of one (context, tau, estimator), ordered by layer."""
    rs = [r for r in report["rows"] if r["context"] == ctx and r["tau"] == tau and r["estimator"] == est]
    return sorted(rs, key=lambda r: r["layer"])


def plot_kept_heatmaps(report: dict, path: str | Path, estimator: str = "antidiagonal",
                       tau: float | None = None) -> None:
    """Write the PNG: per context a heatmap layer x KV head of kept fraction, next to the true mass
    kept per layer.

    Parameters
    ----------
    report : dict
        :func:`lserve.bench.prefill_sparsity.run_prefill_sparsity`'s report.
    path : str or Path
        The PNG to write (nothing without matplotlib).
    estimator : str
        Estimator shown.
    tau : float, optional
        Tau shown (default: the report's first).

    Notes
    -----
    Every KV head of a row keeps the same count, so the heatmap's heads ``h0 ..`` show the fraction
    each head alone would keep (``head_alone_kept_fraction``) and its last column ``kept`` the
    shared count the rule keeps.
    """
    plt = pyplot()
    if plt is None:
        return
    import numpy as np

    tau = report["taus"][0] if tau is None else tau
    contexts = report["contexts"]
    nh = report["num_kv_heads"]
    fig, axes = plt.subplots(1, 2 * len(contexts), figsize=(4.6 * len(contexts), 7.2), squeeze=False,
                             gridspec_kw={"width_ratios": [1.0, 1.15] * len(contexts)})
    im = None
    for i, ctx in enumerate(contexts):
        rs = _by_layer(report, ctx, tau, estimator)
        if not rs:
            continue
        layers = [r["layer"] for r in rs]
        grid = np.array([r["head_alone_kept_fraction"] + [sum(r["kept_fraction"]) / nh] for r in rs])
        ax = axes[0][2 * i]
        im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest",
                       extent=(-0.5, nh + 0.5, layers[-1] + 0.5, layers[0] - 0.5))
        ax.axvline(nh - 0.5, color="white", lw=2)
        for y, row in zip(layers, grid):
            for x, val in enumerate(row):
                ax.text(x, y, f"{val:.2f}", ha="center", va="center", fontsize=5.5,
                        color="black" if val > 0.6 else "white")
        ax.set_xticks(range(nh + 1), [f"h{h}" for h in range(nh)] + ["kept"], fontsize=8)
        ax.set_title(f"context {ctx}: kept fraction\n(h*: the head alone)", fontsize=9)
        if i == 0:
            ax.set_ylabel("layer")
        # The true mass the shared list keeps, per KV head, with the oracle at the same tiles.
        ax = axes[0][2 * i + 1]
        for h in range(nh):
            ax.plot([r["mass"][h] for r in rs], layers, marker=".", ms=3, lw=1.0,
                    color=HEAD_COLOURS[h % len(HEAD_COLOURS)], label=f"h{h}")
        ax.plot([sum(r["oracle_same_kept_mass"]) / nh for r in rs], layers, ls=":", lw=1.4, color="black",
                label="oracle, same tiles (mean)")
        ax.axvline(tau, color="gray", ls="--", lw=0.8)
        ax.set_ylim(layers[-1] + 0.5, layers[0] - 0.5)
        ax.set_xlim(min(0.8, min(min(r["mass"]) for r in rs) - 0.01), 1.005)
        ax.set_title(f"context {ctx}: true mass kept", fontsize=9)
        ax.set_xlabel("attention mass")
        ax.grid(alpha=0.3)
        ax.tick_params(labelleft=False)
        if i == 0:
            ax.legend(fontsize=7, loc="lower left")
    if im is not None:
        fig.colorbar(im, ax=axes[0].tolist(), fraction=0.015, pad=0.01, label="kept tile fraction")
    fig.suptitle(f"{report.get('model', '')}: block-sparse prefill, {estimator} estimator, tau {tau}, "
                 f"KV blocks of {report['block']}, rows of {report['q_block']} queries (no dense tail)", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_kept_by_layer(report: dict, path: str | Path) -> None:
    """Write the PNG: per context (columns) kept fraction (top) and true mass kept (bottom) vs
    layer, means over KV heads; colour = estimator, line style = tau."""
    plt = pyplot()
    if plt is None:
        return
    contexts, taus = report["contexts"], report["taus"]
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(2, len(contexts), figsize=(4.2 * len(contexts), 6.4), sharex=True, sharey="row",
                             squeeze=False)
    for c, ctx in enumerate(contexts):
        for est in report["estimators"]:
            for t, tau in enumerate(taus):
                rs = _by_layer(report, ctx, tau, est)
                if not rs:
                    continue
                layers = [r["layer"] for r in rs]
                kw = {"color": COLOURS.get(est, "tab:gray"), "ls": styles[t % len(styles)], "lw": 1.1}
                for row, key in enumerate(("kept_fraction", "mass")):
                    axes[row][c].plot(layers, [sum(r[key]) / len(r[key]) for r in rs], label=f"{est} tau {tau}",
                                      **kw)
        axes[0][c].set_title(f"context {ctx}", fontsize=9)
        axes[1][c].set_xlabel("layer")
        for row in (0, 1):
            axes[row][c].grid(alpha=0.3)
    axes[0][0].set_ylabel("kept tile fraction")
    axes[1][0].set_ylabel("true attention mass kept")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    fig.suptitle(f"{report.get('model', '')}: block-sparse prefill per layer (mean over KV heads), "
                 f"rows of {report['q_block']} queries", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
