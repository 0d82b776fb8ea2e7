"""GPU smoke of the serving engine path without Ray: the engine as ``lserve serve`` builds it
(time-targeted chunked prefill, CUDA graphs, async decode), a few requests of mixed lengths.

    python scripts/serve_smoke.py [--contexts 2048 32768]    (prints per-request TTFT and step kinds)

A hang dumps every thread's stack after ``--hang-s`` seconds and exits.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time

from lserve.cli import add_engine_args, engine_config_from_args
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams


def main() -> int:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 32768])
    p.add_argument("--hang-s", type=float, default=120)
    a = p.parse_args()
    faulthandler.dump_traceback_later(a.hang_s, exit=True, file=sys.stderr)
    eng = LLMEngine(engine_config_from_args(a))
    import torch

    g = torch.Generator().manual_seed(0)
    for ctx in a.contexts:
        ids = torch.randint(0, eng.model_config.vocab_size - 2, (ctx,), generator=g).tolist()
        t0 = time.perf_counter()
        eng.add_request(ids, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        first = None
        while eng.has_unfinished():
            outs = eng.step()
            if first is None and any(o.token_ids for o in outs):
                first = time.perf_counter() - t0
        print(f"context {ctx}: TTFT {first:.3f} s, total {time.perf_counter() - t0:.3f} s, steps {dict(eng.step_kinds)}, "
              f"budget rate {eng.scheduler.budget.rate}", flush=True)
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
