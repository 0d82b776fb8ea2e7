"""How much one decode selection repeats the last: a trained model against random weights (CPU).

    python scripts/probes/probe_tier_locality.py [--context 7000] [--budget 512] [--steps 96]
        [--out benchmarks/host_tier/probe_tier_locality_cpu.json]

The host KV tier's decode traffic is the picks of each selection that are not resident; with a
resident set that keeps recent selections, that is the share of a selection's picks its earlier
selections did not hold. ``python -m lserve.bench.host_tier`` measures on random weights, whose
queries are unrelated from one step to the next, so their picks are nearly new each selection: the
worst case. This runs the bundled SmolLM2-135M-Instruct (trained) and the same shapes with random
weights (each weight tensor replaced by Gaussian noise of its own mean and spread; norms kept) on
the torch backend, one NIAH prompt of ``--context`` tokens, greedy decoding ``--steps`` tokens with
the engine's selection (16-token pages, 4-token logical pages, ``--budget`` tokens, reuse interval
4, every head dense and every layer selecting, as the bench's llama3-8b runs do; the shipped
calibration of this model selects in 6 of its 30 layers), and records each selecting step's picks per (layer, KV head),
leaving out the sink and the pages the window reads anyway. Per model it reports the mean, over
(layer, head) and selections after the first, of the share of a selection's picks that were in

* ``prev``: the selection just before;
* ``last4``: any of the four before (what a resident set holding ~4 selections would hit);
* ``staged_share``: the share of all picks that a page cache of ``--resident-share`` of the
  selectable pages would have left on the host (what the cupy backend's staging kernel copies a
  selection; 0.66 on random weights at 128k x 16 sequences in the H100 bench), replayed through
  the tier's own policy classes per layer (:class:`~lserve.cache.tier_policy.RecencyPolicy`, and
  :class:`~lserve.cache.tier_policy.RepeatAdmission` with one read a selection, as with staging),
  starting from the most recent pages (what prefill leaves resident); ``staged_share_all``: the
  same installing every miss.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from lserve.attention.torch_backend import TorchBackend
from lserve.cache.tier_policy import RecencyPolicy, RepeatAdmission
from lserve.bench.report import header, write_json
from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.eval.tasks import make_niah_case
from lserve.models.loader import LoadedModel, load_model

PAGE = 16


def random_twin(loaded: LoadedModel, seed: int = 0) -> LoadedModel:
    """``loaded`` with every matrix replaced by Gaussian noise of its mean and spread (1-D tensors,
    the norms, kept): the same shapes and scales, no learned structure."""
    g = torch.Generator().manual_seed(seed)
    w = {}
    for name, t in loaded.weights.items():
        if t.dim() < 2 or not t.is_floating_point():
            w[name] = t
            continue
        f = t.float()
        w[name] = (torch.randn(t.shape, generator=g) * f.std() + f.mean()).to(t.dtype)
    cfg = dataclasses.replace(loaded.config, name=loaded.config.name + "-random")
    return dataclasses.replace(loaded, config=cfg, weights=w)


def picks_of(loaded: LoadedModel, prompt: list[int], budget: int, steps: int, sink: int, local: int) -> dict:
    """Per (layer, head), the picks of each selecting step (logical page indices, window left out)."""
    sp = SparsityConfig(pattern="random", static_sparsity=0.0, sink_tokens=sink, local_tokens=local,
                        token_budget=budget, reuse_interval=4, dynamic_threshold=0, select_layers="all")
    cc = CacheConfig(page_size=PAGE, logical_page_size=4, dense_pool_tokens=len(prompt) + steps + 4 * PAGE)
    eng = LLMEngine(EngineConfig(model="default", sparsity=sp, cache=cc, max_num_seqs=1, max_batched_tokens=2048,
                                 prefix_cache=False, backend="torch", device="cpu"), loaded)
    log: dict[tuple[int, int], list[frozenset]] = {}
    original = TorchBackend._page_table

    def logged(self, layer, s, qd, k=None):
        table = original(self, layer, s, qd, k)
        if s.select:
            last = (s.length - 1) // PAGE - local // PAGE - 1  # pages from here on: the window's
            for h, row in enumerate(table.tolist()):
                log.setdefault((layer, h), []).append(frozenset(i for i in row if sink // PAGE <= i < last))
        return table

    TorchBackend._page_table = logged
    try:
        out = eng.generate([prompt], SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))[0]
    finally:
        TorchBackend._page_table = original
    return {"log": log, "text": out.text}


def overlap(log: dict) -> dict:
    prev, last4 = [], []
    for sels in log.values():
        for i in range(1, len(sels)):
            s = sels[i]
            if not s:
                continue
            prev.append(len(s & sels[i - 1]) / len(s))
            last4.append(len(s & frozenset().union(*sels[max(0, i - 4): i])) / len(s))
    return {"prev": round(statistics.fmean(prev), 4), "last4": round(statistics.fmean(last4), 4),
            "selections": len(prev), "picks_per_selection": round(statistics.fmean(len(s) for v in log.values()
                                                                                   for s in v), 1)}


def replay(log: dict, share: float, admit: str) -> float:
    """Share of the picks on the host when each layer's pages go through a page cache holding
    ``share`` of the selectable pages (the module docstring's ``staged_share``); ``admit``:
    "repeat" (the tier's rule with staging) or "all"."""
    top = 1 + max((p for sels in log.values() for s in sels for p in s), default=0)
    low = min((p for sels in log.values() for s in sels for p in s), default=0)
    cap = max(1, round(share * (top - low)))
    staged = picks = 0
    for layer in sorted({layer for layer, _ in log}):
        heads = [log[k] for k in sorted(log) if k[0] == layer]
        pol, adm = RecencyPolicy(), RepeatAdmission()
        pol.touch(range(top - cap, top))  # prefill leaves its last pages resident
        for i in range(min(len(h) for h in heads)):
            sel = [h[i] for h in heads]
            want = frozenset().union(*sel)
            picks += sum(len(s) for s in sel)
            staged += sum(p not in pol for s in sel for p in s)
            miss = sorted(p for p in want if p not in pol)
            if miss:
                n_heads = [sum(p in s for s in sel) for p in miss]
                ok = adm.admit(miss, n_heads, len(heads), reads=1) if admit == "repeat" else [True] * len(miss)
                install = [p for p, k in zip(miss, ok) if k]
                pol.forget_many(pol.victims(len(install) - (cap - len(pol)), lambda p: p not in want))
                pol.touch(install[: cap - len(pol)])  # as far as clean victims go
            pol.touch(p for p in want if p in pol)
    return round(staged / max(picks, 1), 4)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=7000)
    p.add_argument("--budget", type=int, default=512, help="decode token budget (pages of 16 tokens)")
    p.add_argument("--steps", type=int, default=96, help="decode steps (a selection every 4)")
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--local", type=int, default=256)
    p.add_argument("--resident-share", type=float, default=0.31, help="page cache size over the selectable pages")
    p.add_argument("--out", default="benchmarks/host_tier/probe_tier_locality_cpu.json")
    a = p.parse_args(argv)
    trained = load_model("default")
    case = make_niah_case(trained.tokenizer, a.context, depth=0.5, seed=11)
    rows = {}
    for name, loaded in (("trained", trained), ("random", random_twin(trained))):
        t0 = time.perf_counter()
        r = picks_of(loaded, case.prompt_ids, a.budget, a.steps, a.sink, a.local)
        rows[name] = {**overlap(r["log"]), "staged_share": replay(r["log"], a.resident_share, "repeat"),
                      "staged_share_all": replay(r["log"], a.resident_share, "all"),
                      "seconds": round(time.perf_counter() - t0, 1), "output": r["text"][:80]}
        print(name, rows[name], flush=True)
    report = {**header(), "probe": "tier_locality", "model": trained.config.name, "context": len(case.prompt_ids),
              "budget_tokens": a.budget, "page_size": PAGE, "decode_steps": a.steps, "sink": a.sink,
              "local": a.local, "resident_share": a.resident_share, "rows": rows}
    write_json(a.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
