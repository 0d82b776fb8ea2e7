"""A served engine's prefill without Ray or HTTP: TTFT of long prompts under ``lserve serve``'s step budget.

    python scripts/probes/probe_served_prefill.py OUT_DIR [--contexts 32768 131072] [--configs lserve lserve-sparse]
        [--grids 2048 0] [--paged 1 0 -1] [--variants served "max_batched_tokens=16384,step_time_target=0.5" one-step]

The engine is built from :class:`lserve.serve.settings.ServeSettings` as a served replica builds
it (chunked prefill under the time-targeted step budget), with the served configurations' flags
of ``lserve bench serve``; per (configuration, context) two prompts (different tokens), each
timed to its first token with the prefix cache off unless --prefix-cache (prompts of one seed share their first
tokens), and the steps and chunk sizes it took. Against ``lserve bench e2e``'s
one-step TTFT this separates what chunking costs from what Ray and HTTP add; ``--gpu-busy`` splits
a third prompt's TTFT into GPU-busy seconds and the host gap (a CUDA activity trace). ``--grids`` runs
each configuration once per ``lserve.attention.chunked.CUDNN_CHUNK_GRID`` (0: every chunk on
flash), recording which kernels ran the chunks and each step's seconds; ``--paged`` once per setting of
the paged chunks (``lserve.attention.paged_prefill``: 1, dense chunks with cached past of every prompt
on the paged prefill kernel where it is v5, which makes the grid moot; 0, the gathered cuDNN / flash
paths; -1, as shipped: prompts up to ``PAGED_CHUNKS_MAX_PROMPT`` paged, longer ones on the grid). ``--variants`` runs each
once per set of ServeSettings overrides (``served``: none; ``key=value,...``; ``one-step``: the whole prompt in one
step, the engine's own TTFT for the same prompts). Writes ``probe_served_prefill_h200.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lserve.attention import chunked
from lserve.attention import paged_prefill as bsp
from lserve.bench.gpu_trace import busy_seconds, kernel_seconds
from lserve.bench.report import header
from lserve.bench.serve import CONFIG_FLAGS
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams
from lserve.models.loader import load_model
from lserve.serve.settings import ServeSettings


def _flags(config: str) -> dict:
    """``lserve bench serve``'s flags of a configuration as ServeSettings fields."""
    f = CONFIG_FLAGS[config]
    out = {}
    for name, value in zip(f[::2], f[1::2]):
        key = name.lstrip("-").replace("-", "_")
        default = getattr(ServeSettings, key, None)
        out[key] = None if value == "none" else (str if default is None else type(default))(value)
    return out


def _variant(spec: str, longest: int) -> dict:
    """ServeSettings overrides of a ``--variants`` entry."""
    if spec == "one-step":  # the whole prompt in one step: what ``lserve bench e2e`` times
        return {"max_batched_tokens": longest + 256, "step_time_target": 0.0}
    if spec == "served":
        return {}
    pairs = (item.split("=") for item in spec.split(","))
    return {key: type(getattr(ServeSettings, key))(value) for key, value in pairs}


def ttft(eng: LLMEngine, n: int, seed: int, profiled: bool = False) -> dict:
    """Time one prompt of ``n`` tokens to its first token; ``profiled``: under torch.profiler's
    CUDA activity trace, adding the seconds the GPU was busy and the rest (``host_gap_s``: the
    GPU waited for the host; an upper bound, the trace slows the host a little)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, eng.model_config.vocab_size - 2, (n,), generator=g).tolist()
    eng.add_request(ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    trace = profile(activities=[ProfilerActivity.CUDA]) if profiled else contextlib.nullcontext()
    with trace:
        t0, chunks, secs = time.perf_counter(), [], []
        kernels = dict(eng.backend.chunk_kernels)
        while True:
            outs = eng.step()
            chunks.append(eng.last_step_info["prefill_tokens"])
            secs.append(round(eng.last_step_info["seconds"], 4))
            if any(o.token_ids for o in outs):
                break
        t = time.perf_counter() - t0
    kernels = {k: v - kernels.get(k, 0) for k, v in eng.backend.chunk_kernels.items()}
    while eng.has_unfinished():
        eng.step()
    row = {"ttft_s": round(t, 3), "steps": len(chunks), "chunks": chunks, "step_s": secs,
           "chunk_kernels": {k: v for k, v in kernels.items() if v}}
    if profiled:
        events = trace.events()
        busy = busy_seconds(events)
        row.update(profiled=True, gpu_busy_s=round(busy, 3), host_gap_s=round(t - busy, 3),
                   kernel_s=kernel_seconds(events))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--configs", nargs="+", default=["lserve-sparse", "lserve"], choices=list(CONFIG_FLAGS))
    ap.add_argument("--grids", type=int, nargs="+", default=[chunked.CUDNN_CHUNK_GRID])
    ap.add_argument("--paged", type=int, nargs="+", default=[-1], choices=[-1, 0, 1],
                    help="chunks with a past on the paged prefill kernel: 1 every prompt, 0 none, -1 as shipped "
                         "(prompts up to paged_prefill.PAGED_CHUNKS_MAX_PROMPT tokens)")
    ap.add_argument("--variants", nargs="+", default=["served"])
    ap.add_argument("--max-cache-tokens", type=int, default=None,
                    help="KV pool size (default: the longest context + 4096; the serve bench's server holds 4x that)")
    ap.add_argument("--prefix-cache", action="store_true", help="keep the prefix cache on, as a server does")
    ap.add_argument("--gpu-busy", action="store_true",
                    help="a third prompt per context under the CUDA activity trace: GPU-busy seconds and the host gap")
    a = ap.parse_args()
    loaded = load_model("llama3-8b", dtype=torch.bfloat16, device="cuda")
    rows, path = [], Path(a.out, "probe_served_prefill_h200.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    shipped_max = bsp.PAGED_CHUNKS_MAX_PROMPT
    runs = ((c, g, pg, v) for c in a.configs for g in a.grids for pg in a.paged for v in a.variants)
    for config, grid, paged, variant in runs:
        if variant == "one-step" and (grid, paged) != (a.grids[0], a.paged[0]):
            continue  # one step runs no chunk with a past: neither setting changes it
        chunked.CUDNN_CHUNK_GRID = grid  # both read when the backend is built
        bsp.PAGED_DENSE_CHUNKS = paged != 0
        bsp.PAGED_CHUNKS_MAX_PROMPT = max(a.contexts) if paged == 1 else shipped_max
        over = _variant(variant, max(a.contexts))
        st = ServeSettings(model="llama3-8b", device="cuda", backend="cupy", max_model_len=max(a.contexts) + 256,
                           max_cache_tokens=a.max_cache_tokens or max(a.contexts) + 4096, max_num_seqs=4,
                           prefix_cache=a.prefix_cache,
                           **{**_flags(config), **over})
        eng = LLMEngine(st.engine_config(), loaded)
        tag = f"{config} grid {grid} paged {paged} {variant}"
        if variant != "one-step":  # as a served replica does (one step runs no chunk with a past)
            print(f"{tag}: warm-up {eng.warm_up():.1f} s", flush=True)
        ttft(eng, 2048, 0)  # warm-up
        for n in a.contexts:
            for seed in (1, 2, 3) if a.gpu_busy else (1, 2):
                r = {"config": config, "grid": grid, "paged": paged, "variant": variant, "context": n, "seed": seed,
                     **ttft(eng, n, seed, profiled=seed == 3)}
                rows.append(r)
                path.write_text(json.dumps({**header(), "rows": rows}, indent=1))  # each row: a cut-off run keeps it
                gap = f" (profiled: GPU busy {r['gpu_busy_s']} s, host gap {r['host_gap_s']} s)" if r.get("profiled") else ""
                print(f"{tag} {n} seed {seed}: TTFT {r['ttft_s']} s in {r['steps']} steps, "
                      f"chunks {r['chunks'][:6]}...{r['chunks'][-3:]} kernels {r['chunk_kernels']}{gap}", flush=True)
                for name, sec in list(r.get("kernel_s", {}).items())[:12]:
                    print(f"    {sec:8.3f} s  {name}", flush=True)
        del eng
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
