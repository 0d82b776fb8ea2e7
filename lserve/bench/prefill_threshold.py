"""``lserve bench profile-prefill-threshold``: the prompt length from which block-sparse prefill pays.

For each context of a sweep, one engine (this device, this model shape, the given backend,
the whole prompt in one step) prefills random prompts with block-sparse prefill of the dense heads
at ``tau`` (the engine's setting: "auto", the model's shipped per-layer taus, by default) and dense
(a per-request override of 0 on the same engine), each timed to its first
token, the better of two prompts per point (a fresh engine's first long prompt is slower on the
H200, ``scripts/probes/probe_first_prefill.py``). The threshold is the smallest context from which the
sparse prefill is faster at every larger measured context; it is saved as ``min_len`` in the
prefill profile that engines with ``prefill_sparsity_min_len = -1`` read
(:mod:`lserve.sparsity.threshold`), and the sweep is written as JSON + PNG.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from lserve.bench.e2e import measure_engine
from lserve.bench.report import header
from lserve.bench.threshold import finish_sweep
from lserve.calibration.threshold_sweep import first_paying
from lserve.config import CacheConfig, ConfigError, EngineConfig, SparsityConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.models.loader import load_model
from lserve.sparsity.threshold import PREFILL, profile_key

#: Faster by less than this share of the dense time does not count as paying: on a CPU two runs
#: of the same prefill differ by a few percent, and a sparse prefill's chunks align to its row grid.
PAY_MARGIN = 0.03
TAU = -1.0  # "auto": the setting engines run by default (SparsityConfig.prefill_sparsity)


def default_contexts(device: str) -> list[int]:
    """Up to 256k on a GPU, 8k on a CPU (its prefill is slow)."""
    return [8192, 16384, 32768, 65536, 131072, 262144] if device.startswith("cuda") else [1024, 2048, 4096, 8192]


def run_prefill_threshold(model: str = "default", device: str = "cpu", backend: str = "torch", tau: float = TAU,
                          contexts: list[int] | None = None, out_dir: str | Path | None = "benchmarks",
                          name: str | None = None, profile_file: str | Path | None = None,
                          save: bool = True) -> dict:
    """Measure the sweep, save ``min_len`` (unless ``save`` is False) and write the report.

    Returns
    -------
    dict
        The report: ``key``, ``tau``, ``min_len`` (the threshold, None if sparse prefill never
        paid), ``rows`` [{context, dense_s, sparse_s}], ``saved_to``.
    """
    contexts = sorted(contexts or default_contexts(device))
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    loaded = load_model(model, dtype=dtype, device=device)
    top = max(contexts) + 64
    # the model's own streaming pattern (auto) and prefill sparsity at tau from the first token; dense rows turn it off
    sp = SparsityConfig(prefill_sparsity=tau, prefill_sparsity_min_len=0)
    eng = LLMEngine(EngineConfig(model=model, sparsity=sp, cache=CacheConfig(dense_pool_tokens=top), device=device,
                                 backend=backend, max_num_seqs=1, max_batched_tokens=top, max_model_len=top,
                                 prefix_cache=False), loaded)
    if eng.sparsity.prefill_sparsity == 0:
        raise ConfigError(f"model {model!r} ships no prefill calibration for prefill_sparsity auto: "
                          "give --prefill-sparsity TAU (or calibrate it: lserve calibrate-prefill)")
    label = "auto" if tau < 0 else tau
    measure_engine(eng, 128, 1)  # warm-up: kernels compiled, allocator primed
    rows = []
    for ctx in tqdm(contexts, desc="profile-prefill-threshold", unit="context"):
        row = {"context": ctx}
        for col, override in (("dense_s", 0.0), ("sparse_s", None)):
            row[col] = round(min(measure_engine(eng, ctx, 1, seed=s, prefill_sparsity=override)[0]
                                 for s in (1, 2)), 4)
        rows.append(row)
    threshold, min_len = first_paying(rows, "dense_s", "sparse_s", PAY_MARGIN)
    key = profile_key(device, loaded.config, dtype)
    report = {**header(), "key": key, "model": model, "backend": backend, "tau": label, "margin": PAY_MARGIN, "min_len": min_len,
              "threshold": threshold, "rows": rows, "saved_to": None}
    finish_sweep(report, ("min_len", "threshold", "tau", "margin", "backend", "date", "command", "rows"), PREFILL,
                 profile_file if save else False, out_dir,
                 name or ("prefill_threshold_" + ("cpu" if device == "cpu" else "gpu") + f"_{model}"),
                 (("dense_s", "dense prefill"), ("sparse_s", f"block-sparse prefill (tau {label})")),
                 "time to first token, s", "prompt tokens", log_y=True)
    shown = "never within the sweep" if threshold is None else f"{threshold} tokens"
    print(f"{key}: block-sparse prefill (tau {label}) pays from {shown}; min_len {min_len}"
          + (f"; saved to {report['saved_to']}" if report["saved_to"] else ""))
    return report
