"""Why a long prompt's TTFT exceeds its kernels' time: first vs second prompt of one length, host hot spots.

    python scripts/probes/probe_first_prefill.py OUT_DIR [--contexts 65536 131072] [--configs dense lserve]

Per (config, context): an engine as ``lserve bench e2e`` builds it (``_engine``, 256-token
warm-up), then two prompts of that length (different tokens, no prefix hit), each timed to its
first token; the first under cProfile (its 15 costliest host functions by own time). Also the
first and a later call of SDPA's causal GQA attention at that length, alone (cuDNN builds a plan
per new shape). Writes ``probe_first_prefill_h200.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lserve.bench.e2e import CONFIGS, _engine, measure_engine
from lserve.bench.report import header
from lserve.models.loader import load_model


def sdpa_first_call(n: int, hq: int = 32, hkv: int = 8, d: int = 128) -> dict:
    """Wall seconds of the first and of a later SDPA call at length ``n`` (synchronised)."""
    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
        times.append(round(time.perf_counter() - t0, 4))
    return {"context": n, "sdpa_call_s": times}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--contexts", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--configs", nargs="+", default=["dense", "lserve"], choices=list(CONFIGS))
    a = ap.parse_args()
    loaded = load_model("llama3-8b", dtype=torch.bfloat16, device="cuda")
    rows = [sdpa_first_call(n) for n in a.contexts]
    for r in rows:
        print(r, flush=True)
    for config in a.configs:
        for n in a.contexts:
            eng = _engine(loaded, "llama3-8b", CONFIGS[config], n, "cuda", "cupy", decode_steps=4)
            measure_engine(eng, 256, 4)
            prof = cProfile.Profile()
            prof.enable()
            first, _ = measure_engine(eng, n, 4, seed=0)
            prof.disable()
            second, _ = measure_engine(eng, n, 4, seed=1)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
            hot = [ln.strip() for ln in s.getvalue().splitlines() if ln.strip()[:1].isdigit()][:15]
            rows.append({"config": config, "context": n, "ttft_first_s": round(first, 3),
                         "ttft_second_s": round(second, 3), "host_hot": hot})
            print(f"{config} {n}: TTFT first {first:.3f} s (under cProfile), second {second:.3f} s", flush=True)
            print("\n".join(hot[:12]), flush=True)
            del eng
            gc.collect()
            torch.cuda.empty_cache()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "probe_first_prefill_h200.json").write_text(json.dumps({**header(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
