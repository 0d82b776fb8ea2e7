"""``lserve bench cpu``: prefill and decode throughput of our engine vs transformers on this CPU.

Both run the default model (the same dequantized weights) in float32 in the same process;
transformers uses SDPA and ``generate``. Decode throughput is measured at the given prompt
length: (time of prompt + N tokens - time of prompt + 1 token) / (N - 1).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from lserve.bench.report import header, write_json
from lserve.config import EngineConfig, SparsityConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams
from lserve.models.loader import default_model_path, load_model
from lserve.plotting import pyplot

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def _prompt_ids(tok, n: int) -> list[int]:
    ids = tok.encode(FILLER * (n // 10 + 10))
    return ids[:n]


def _ours(engine: LLMEngine, ids: list[int], decode_tokens: int) -> tuple[float, float]:
    """(prefill s, decode s per token) for one request through the engine's step loop."""
    engine.add_request(ids, SamplingParams(max_tokens=decode_tokens + 1, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    prefill_end = None
    while engine.has_unfinished():
        outs = engine.step()
        if prefill_end is None and any(o.token_ids for o in outs):
            prefill_end = time.perf_counter()
    end = time.perf_counter()
    return prefill_end - t0, (end - prefill_end) / decode_tokens


def _hf_model(loaded):
    from transformers import AutoConfig, LlamaForCausalLM

    p = default_model_path()
    cfg = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(loaded.weights, strict=False)  # lm_head is tied to the embedding
    model.tie_weights()
    return model.eval()


@torch.inference_mode()
def _hf(model, ids: list[int], decode_tokens: int) -> tuple[float, float]:
    x = torch.tensor([ids])
    kw = dict(do_sample=False, pad_token_id=0)
    t0 = time.perf_counter()
    model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
    t1 = time.perf_counter()
    model.generate(x, max_new_tokens=decode_tokens + 1, min_new_tokens=decode_tokens + 1, **kw)
    t2 = time.perf_counter()
    return t1 - t0, ((t2 - t1) - (t1 - t0)) / decode_tokens


def run_cpu_bench(out_dir: str | Path = "benchmarks", prompt_lens=(1024, 4096), decode_tokens: int = 32) -> dict:
    """Measure and write ``cpu_engine.json`` + ``cpu_engine.png`` into ``out_dir``."""
    loaded = load_model("default")
    # the configuration `lserve serve` runs by default: learned pattern, budget 4096, profiled threshold
    sp = SparsityConfig(pattern="auto")
    engine = LLMEngine(EngineConfig(model="default", sparsity=sp, max_batched_tokens=max(prompt_lens)), loaded)
    hf = _hf_model(loaded)
    rows = []
    _ours(engine, _prompt_ids(loaded.tokenizer, 64), 2)  # warm-up
    for n in tqdm(list(prompt_lens), desc="cpu bench", unit="prompt"):
        ids = _prompt_ids(loaded.tokenizer, n)
        p_s, d_s = _ours(engine, ids, decode_tokens)
        hp_s, hd_s = _hf(hf, ids, decode_tokens)
        rows.append({"prompt_tokens": n, "prefill_tok_s": round(n / p_s, 1), "decode_tok_s": round(1 / d_s, 2),
                     "hf_prefill_tok_s": round(n / hp_s, 1), "hf_decode_tok_s": round(1 / hd_s, 2),
                     "decode_speedup": round(hd_s / d_s, 3)})
    planner = engine.backend.planner
    budget = engine.config.sparsity.token_budget
    report = {**header(), "model": loaded.source, "decode_tokens": decode_tokens,
              "engine": ("LServe serve defaults (torch backend, fp32, learned pattern: 50% streaming heads, "
                         "budget 4096, profiled threshold)"),
              "dynamic_threshold_tokens": planner.threshold(budget) if budget else None,
              "threshold_profile": engine.threshold_source, "rows": rows}
    out = Path(out_dir)
    write_json(out / "cpu_engine.json", report)
    _plot(rows, out / "cpu_engine.png")
    for r in rows:
        print(f"{r['prompt_tokens']:>6} tokens  prefill {r['prefill_tok_s']:>8} tok/s (hf {r['hf_prefill_tok_s']})"
              f"  decode {r['decode_tok_s']:>6} tok/s (hf {r['hf_decode_tok_s']})")
    return report


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    x = [r["prompt_tokens"] for r in rows]
    for ax, key, title in ((axes[0], "prefill_tok_s", "prefill"), (axes[1], "decode_tok_s", "decode")):
        ax.plot(x, [r[key] for r in rows], "o-", label="LServe (torch backend)")
        ax.plot(x, [r["hf_" + key] for r in rows], "s--", label="transformers generate")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{title}, SmolLM2-135M, CPU")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
