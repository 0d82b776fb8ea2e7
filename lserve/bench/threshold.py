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
from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.models.loader import load_model
from lserve.plotting import pyplot
from lserve.sparsity.threshold import choose_ratio, profile_key, save_profile


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
    eng = LLMEngine(EngineConfig(model=model, sparsity=sp, cache=CacheConfig(max_tokens=top), device=device,
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
    if save:
        entry = {k: report[k] for k in ("ratio", "threshold", "budget", "reuse_interval", "backend", "date",
                                        "command", "rows")}
        report["saved_to"] = str(save_profile(key, entry, profile_file))
    if out_dir is not None:
        stem = name or ("threshold_" + ("cpu" if device == "cpu" else "gpu") + f"_{model}")
        write_json(Path(out_dir) / f"{stem}.json", report)
        _plot(report, Path(out_dir) / f"{stem}.png")
    shown = "never within the sweep" if threshold is None else f"{threshold} tokens"
    print(f"{key}: dynamic selection pays from {shown} at budget {budget} (ratio {ratio:.3g})"
          + (f"; saved to {report['saved_to']}" if report["saved_to"] else ""))
    return report


def _plot(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    rows = report["rows"]
    x = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(x, [r["dense_ms"] for r in rows], "o-", label="dense heads read every page")
    ax.plot(x, [r["dynamic_ms"] for r in rows], "s-", label=f"dynamic selection (budget {report['budget']})")
    if report["threshold"]:
        ax.axvline(report["threshold"], color="k", ls=":", label=f"threshold {report['threshold']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("decode ms / token")
    ax.set_title(report["key"], fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
