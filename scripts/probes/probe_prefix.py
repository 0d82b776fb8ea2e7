"""The engine's own TTFT of repeated questions on one document, prefix cache on (no HTTP, no Ray).

    python scripts/probes/probe_prefix.py

llama3-8b preset on the cupy backend with the server's step defaults; for an 8k and a 32k
document, three questions of 64 tokens each, one generated token: prints TTFT, the steps and
the engine's prefix-cache hit counter. Separates the engine's part of a cached TTFT from the
serving layer's (``lserve bench serve --prefix-contexts`` measures it through HTTP).
"""
import random
import time

import torch

from lserve.bench.e2e import CONFIGS
from lserve.config import CacheConfig, EngineConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams
from lserve.models.loader import load_model


def main() -> None:
    loaded = load_model("llama3-8b", dtype=torch.bfloat16, device="cuda")
    eng = LLMEngine(EngineConfig(model="llama3-8b", sparsity=CONFIGS["lserve"], device="cuda", backend="cupy",
        cache=CacheConfig(dense_pool_tokens=80000), max_num_seqs=8, max_batched_tokens=8192, max_model_len=40000,
        step_time_target=0.25, itl_slo_ms=100.0), loaded)
    rng = random.Random(0)
    for ctx in (8192, 32768):
        doc = [rng.randrange(120000) for _ in range(ctx)]
        for q in range(3):
            ids = doc + [rng.randrange(120000) for _ in range(64)]
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
            t_add = time.perf_counter() - t
            steps = []
            while eng.has_unfinished():
                eng.step()
                info = eng.last_step_info
                steps.append((round(info["seconds"] * 1e3, 1), info["prefill_tokens"]))
            torch.cuda.synchronize()
            st = eng.stats()
            print(ctx, q, "ttft", round(time.perf_counter() - t, 4), "add_ms", round(t_add * 1e3, 1), "steps", steps[:6],
                  "hits", st.prefix_cache_hits, flush=True)


if __name__ == "__main__":
    main()
