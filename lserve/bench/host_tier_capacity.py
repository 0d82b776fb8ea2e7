"""The longest context one replica holds for one request, all-GPU and with the host KV tier (issue
39 target a), shown by building each engine rather than by arithmetic alone.

``python -m lserve.bench.host_tier OUT --capacity [--kv-quant int4] [--host-kv-gib G] [--gpu-kv-gib D]``:
per mode, :func:`lserve.bench.host_tier_sizes.max_context` sizes the engine (the device pool; with
the tier its resident set, the key statistics of every page and ``G`` GiB of host pages), the
engine is built (the pinned host pool allocated), and the row records the tokens its allocators
hold for one sequence (:func:`~lserve.bench.host_tier_concurrency.admits` at that length) and
whether a request of that many prompt tokens passes its admission check. Nothing is prefilled: a
10M-token prefill takes hours (``host_tier_notes.md``), so serving at this length end to end is not
measured here. Writes ``OUT/host_tier_capacity.json``.

An engine takes device memory beyond its KV cache that grows with its ``max_model_len`` (decode-graph
and selection buffers; RoPE tables for the whole length until session 24): on the H200 at 5.5M tokens
it was more than the 8 GiB reserve, and the first all-GPU engine sized from the cache's bytes alone
ran out of memory. So on a GPU that overhead is measured first, by building the engine at the
mode's length with a small pool, and taken from the device budget before sizing the pool; a
build that still runs out of memory is recorded in its row, not raised. Each row's
``overhead_parts`` says where that overhead went (torch's allocations by the lserve line that
made them, torch's unused reserve, CuPy's pool, the rest).

Each engine loads its own weights and keeps only those its model uses, as a served replica does;
the bench holds none. (Until session 26 the engines shared the bench's loaded checkpoint and added
their fused q/k/v, gate/up and o copies beside it: 9.5 GiB of Llama-3-8B counted as overhead.)
So the overhead measured here includes the weights, and the device budget is what is free with
nothing loaded, less the reserve.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from lserve.bench.host_tier_common import admits, free_memory, make_engine, overhead_bytes, setup
from lserve.bench.host_tier_sizes import engine_pools, max_context
from lserve.bench.report import header, write_json

DECODE_ROOM = 64  # tokens past the prompt the request may generate
ATTEMPTS, SHRINK = 3, 0.05  # builds per mode, each after an out-of-memory one with this share less


def _accepts(eng, tokens: int) -> str | None:
    """None if a request of ``tokens`` prompt tokens passes the engine's admission check, else why not."""
    from lserve.engine.request_check import RequestError
    from lserve.engine.sampling import SamplingParams

    try:
        eng.check_request([1] * tokens, SamplingParams(max_tokens=DECODE_ROOM))
    except RequestError as e:
        return str(e)
    return None


def _build(st, mode: str, gpu_bytes: float, over: float, parts: dict) -> dict:
    """One mode's row: its engine sized from ``gpu_bytes`` of the device, built and checked."""
    sz, mbt = st.sizes, st.settings.max_batched_tokens
    tokens = max_context(sz, gpu_bytes, st.host_bytes, mbt)[mode] - DECODE_ROOM - sz.page_size
    pool, host_gib = engine_pools(sz, gpu_bytes, st.host_bytes, 1, mbt, tier=mode == "tier")
    print(f"{mode}: building an engine for {tokens} tokens (pool {pool} tokens, host {host_gib:.2f} GiB, "
          f"{over / 2**30:.2f} GiB of the device beside the cache, weights included)", flush=True)
    row = {"mode": mode, "tokens": tokens, "pool_tokens": pool, "host_kv_gib": round(host_gib, 3),
           "gpu_kv_bytes": gpu_bytes, "overhead_gib": round(over / 2**30, 3), "overhead_parts": parts}
    t0 = time.perf_counter()
    try:
        eng = make_engine(st, pool, host_gib, 1, tokens + DECODE_ROOM)
    except torch.OutOfMemoryError as e:
        row["error"] = f"out of device memory: {str(e).splitlines()[0]}"
        print(f"    {row['error']}", flush=True)
    else:
        row.update(build_s=round(time.perf_counter() - t0, 1), held_sequences=admits(eng, tokens + DECODE_ROOM),
                   refused=_accepts(eng, tokens))
        print(f"    held {row['held_sequences']} sequence(s) of {tokens} tokens; admission: "
              f"{row['refused'] or 'accepted'} ({row['build_s']} s to build)", flush=True)
        del eng
    free_memory()
    return row


def run(settings, out_dir: str | Path) -> dict:
    """Both modes; returns the report written."""
    st = setup(settings, keep_weights=False)  # engines load their own weights: the bench holds none
    sz, mbt = st.sizes, settings.max_batched_tokens
    mx = max_context(sz, st.gpu_bytes, st.host_bytes, mbt)
    report = {**header(), **st.header(), "mode": "capacity", "max_context": mx, "rows": []}
    path = Path(out_dir) / "host_tier_capacity.json"
    for mode in ("gpu", "tier"):
        # the overhead at the length sized without it: a shorter engine takes no more
        over, parts = overhead_bytes(st, mx[mode] + DECODE_ROOM)
        for attempt in range(ATTEMPTS):  # what the probe missed (memory that grows with the pool): 5% less a time
            gpu_bytes = (st.gpu_bytes - over) * (1 - SHRINK * attempt)
            row = {**_build(st, mode, gpu_bytes, over, parts), "attempts": attempt + 1}
            if "error" not in row:
                break
        report["rows"].append(row)
        write_json(path, report)
    print(f"wrote {path}", flush=True)
    return report
