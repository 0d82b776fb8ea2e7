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
"""

from __future__ import annotations

import time
from pathlib import Path

from lserve.bench.host_tier_common import free_memory, make_engine, setup
from lserve.bench.host_tier_concurrency import admits
from lserve.bench.host_tier_sizes import engine_pools, max_context
from lserve.bench.report import header, write_json

DECODE_ROOM = 64  # tokens past the prompt the request may generate


def _accepts(eng, tokens: int) -> str | None:
    """None if a request of ``tokens`` prompt tokens passes the engine's admission check, else why not."""
    from lserve.engine.request_check import RequestError
    from lserve.engine.sampling import SamplingParams

    try:
        eng.check_request([1] * tokens, SamplingParams(max_tokens=DECODE_ROOM))
    except RequestError as e:
        return str(e)
    return None


def run(settings, out_dir: str | Path) -> dict:
    """Both modes; returns the report written."""
    st = setup(settings)
    sz, mbt = st.sizes, settings.max_batched_tokens
    mx = max_context(sz, st.gpu_bytes, st.host_bytes, mbt)
    report = {**header(), **st.header(), "mode": "capacity", "max_context": mx, "rows": []}
    path = Path(out_dir) / "host_tier_capacity.json"
    for mode in ("gpu", "tier"):
        tokens = mx[mode] - DECODE_ROOM - sz.page_size
        pool, host_gib = engine_pools(sz, st.gpu_bytes, st.host_bytes, 1, mbt, tier=mode == "tier")
        print(f"{mode}: building an engine for {tokens} tokens (pool {pool} tokens, host {host_gib:.2f} GiB)", flush=True)
        t0 = time.perf_counter()
        eng = make_engine(st, pool, host_gib, 1, tokens + DECODE_ROOM)
        row = {"mode": mode, "tokens": tokens, "pool_tokens": pool, "host_kv_gib": round(host_gib, 3),
               "build_s": round(time.perf_counter() - t0, 1), "held_sequences": admits(eng, tokens + DECODE_ROOM),
               "refused": _accepts(eng, tokens)}
        report["rows"].append(row)
        print(f"    held {row['held_sequences']} sequence(s) of {tokens} tokens; admission: "
              f"{row['refused'] or 'accepted'} ({row['build_s']} s to build)", flush=True)
        write_json(path, report)
        del eng
        free_memory()
    print(f"wrote {path}", flush=True)
    return report
