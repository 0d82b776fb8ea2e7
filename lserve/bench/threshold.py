"""``lserve bench profile-threshold``: the context length from which dynamic selection pays.

For each context of a sweep, one engine (this device, this model shape, the given backend)
decodes the same random prompt twice: dense heads reading every page (per-request budget 0)
and with dynamic selection (budget B, reuse interval C, selection forced on). The threshold is
the smallest context from which selection is faster at every larger measured context; it is
saved as a ratio to the budget in the profile file engines read by default
(:mod:`lserve.sparsity.threshold`), and the sweep is written as JSON + PNG.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from lserve.bench.e2e import measure_engine
from lserve.bench.report import header, write_json
from lserve.calibration.threshold_sweep import choose_ratio
from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.models.loader import load_model
from lserve.plotting import pyplot
from lserve.sparsity.threshold import DECODE, profile_key, save_profile


def default_contexts(budget: int, device: str) -> list[int]:
    """Multiples of the budget: up to 16x on a GPU, 4x on a CPU (prefill there is slow)."""
    mults = (1.25, 1.5, 2, 3, 4, 8, 16) if device.startswith("cuda") else (1.25, 1.5, 2, 3, 4)
    return [int(budget * m) // 64 * 64 for m in mults]


def run_profile_threshold(model: str = "default", device: str = "cpu", backend: str = "torch",
                          budget: int = 4096, contexts: list[int] | None = None, decode_steps: int = 32,
                          reuse_interval: int = 4, out_dir: str | Path | None = "benchmarks",
                          name: str | None = None, profile_file: str | Path | None = None,
                          save: bool = True) -> dict:
    """Measure the sweep, save the ratio (unless ``save`` is False) and write the report.

    Returns
    -------
    dict
        The report: ``key``, ``ratio``, ``threshold`` (tokens at ``budget``, None if selection
        never paid), ``rows`` [{context, dense_ms, dynamic_ms}], ``saved_to``.
    """
    contexts = sorted(contexts or default_contexts(budget, device))
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    loaded = load_model(model, dtype=dtype, device=device)
    top = max(contexts) + decode_steps + 64
    sp = SparsityConfig(token_budget=budget, reuse_interval=reuse_interval, dynamic_threshold=0)
    chunk = max(top, 16) if device.startswith("cuda") else 2048
    eng = LLMEngine(EngineConfig(model=model, sparsity=sp, cache=CacheConfig(dense_pool_tokens=top), device=device,
                                 backend=backend, max_num_seqs=1, max_batched_tokens=chunk, max_model_len=top),
                    loaded)
    measure_engine(eng, 128, 4)  # warm-up: kernels compiled, allocator primed
    rows = []
    for ctx in tqdm(contexts, desc="profile-threshold", unit="context"):
        _, dense = measure_engine(eng, ctx, decode_steps, token_budget=0)
        _, dyn = measure_engine(eng, ctx, decode_steps, token_budget=budget)
        rows.append({"context": ctx, "dense_ms": round(dense * 1e3, 4), "dynamic_ms": round(dyn * 1e3, 4)})
    ratio, threshold = choose_ratio(rows, budget)
    key = profile_key(device, loaded.config, dtype)
    report = {**header(), "key": key, "model": model, "backend": backend, "budget": budget,
              "reuse_interval": reuse_interval, "decode_steps": decode_steps, "ratio": round(ratio, 4),
              "threshold": threshold, "rows": rows, "saved_to": None}
    entry_keys = ("ratio", "threshold", "budget", "reuse_interval", "backend", "date", "command", "rows")
    finish_sweep(report, entry_keys, DECODE, profile_file if save else False, out_dir,
                 name or ("threshold_" + ("cpu" if device == "cpu" else "gpu") + f"_{model}"),
                 (("dense_ms", "dense heads read every page"), ("dynamic_ms", f"dynamic selection (budget {budget})")),
                 "decode ms / token", "context tokens")
    shown = "never within the sweep" if threshold is None else f"{threshold} tokens"
    print(f"{key}: dynamic selection pays from {shown} at budget {budget} (ratio {ratio:.3g})"
          + (f"; saved to {report['saved_to']}" if report["saved_to"] else ""))
    return report


def finish_sweep(report: dict, entry_keys: tuple[str, ...], kind: str, profile_file, out_dir, stem: str,
                 series: tuple[tuple[str, str], ...], ylabel: str, xlabel: str, log_y: bool = False) -> None:
    """Save a threshold sweep's profile entry and write its report + plot (both profiling benches).

    ``profile_file``: where to save (None: the user's file of ``kind``; False: not saved);
    ``series``: (row field, label) per line of the plot; ``out_dir`` None writes no files."""
    if profile_file is not False:
        entry = {k: report[k] for k in entry_keys}
        report["saved_to"] = str(save_profile(report["key"], entry, profile_file, kind=kind))
    if out_dir is not None:
        write_json(Path(out_dir) / f"{stem}.json", report)
        _plot(report, Path(out_dir) / f"{stem}.png", series, ylabel, xlabel, log_y)


def _plot(report: dict, path: Path, series, ylabel: str, xlabel: str, log_y: bool) -> None:
    plt = pyplot()
    if plt is None:
        return

    rows = report["rows"]
    x = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for (col, label), style in zip(series, ("o-", "s-")):
        ax.plot(x, [r[col] for r in rows], style, label=label)
    if report["threshold"]:
        ax.axvline(report["threshold"], color="k", ls=":", label=f"threshold {report['threshold']}")
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(report["key"], fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
