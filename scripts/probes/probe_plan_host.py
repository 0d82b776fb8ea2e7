"""Host time of planning one prefill chunk with a long cached past (issue 40: where a served chunk's time goes).

    python scripts/probes/probe_plan_host.py OUT_DIR [--model llama3-8b] [--chunks 8192:6144 65536:4096 126976:4096]

Per ``start:n`` chunk of one sequence: the step plan (``StepPlanner.plan``, the torch backend's,
which the cupy backend extends) and the cupy kernels' host tables (``CupyPlanner.plan`` and the
packing of the one upload), on a KV cache on the ``meta`` device (no memory, no GPU), the lserve
sparsity of the preset (half the KV heads streaming). Medians of ``--repeats``; this is the host
work a served prefill-only step does before its first kernel (the GPU waits for it once per chunk
after the step's synchronize). Writes ``probe_plan_host_<device tag>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lserve.attention.cupy_plan import CupyPlanner, PlanGeometry
from lserve.attention.torch_backend import TorchBackend
from lserve.bench.report import header
from lserve.cache.kv_cache import KVCache
from lserve.config import CacheConfig, SparsityConfig
from lserve.models.presets import preset_config
from lserve.sparsity.patterns import HeadLayout, random_pattern
from lserve.sparsity.plan import SeqStep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--chunks", nargs="+", default=["8192:6144", "65536:4096", "126976:4096"])
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    mc = preset_config(a.model)
    sp = SparsityConfig(pattern="random", sink_tokens=64, local_tokens=256, token_budget=4096)
    layout = HeadLayout.from_pattern(random_pattern(mc.num_layers, mc.num_kv_heads, 0), mc.num_layers,
                                     mc.num_kv_heads, 0.5, sp.dense_layers)
    chunks = [tuple(int(x) for x in c.split(":")) for c in a.chunks]
    page = 64
    longest = max(s + n for s, n in chunks)
    cache = KVCache(mc, CacheConfig(page_size=page, logical_page_size=16, num_pages=longest // page + 64),
                    layout.n_dense(), sp.sink_tokens, sp.local_tokens, 4, torch.bfloat16, "meta")
    backend = TorchBackend(mc, sp, cache)
    tables = CupyPlanner(PlanGeometry.of(backend, 4, True))
    rows = []
    for start, n in chunks:
        step = [SeqStep(0, start, n, False, list(range(-(-(start + n) // page))), list(range(7)))]
        plan_s, table_s = [], []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            plan = backend.planner.plan(step)
            t1 = time.perf_counter()
            st = tables.plan(plan, split=None)
            if st.arrays:
                st.pack(units=True)
            t2 = time.perf_counter()
            plan_s.append(t1 - t0)
            table_s.append(t2 - t1)
        row = {"start": start, "n": n, "step_plan_ms": round(statistics.median(plan_s) * 1e3, 3),
               "cupy_tables_ms": round(statistics.median(table_s) * 1e3, 3)}
        rows.append(row)
        print(row, flush=True)
    tag = "h200" if torch.cuda.is_available() else "cpu"
    path = Path(a.out, f"probe_plan_host_{tag}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**header(), "model": a.model, "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
