"""Host time of the host KV tier's page moves with most of the resident set hot (CPU model).

    python scripts/probes/probe_tier_victims.py --label before|after [--layers 4] [--decode-steps 32]
        [--count] [--out benchmarks/host_tier/probe_tier_victims_cpu.json]

Models the H100 concurrency run that decoded at 10 s a step (llama3-8b, bf16 KV, 16 sequences of
128k tokens, ``--host-kv-gib 90``, ``--max-batched-tokens 32768``): a :class:`HostTier` built
directly over tiny CPU :class:`PagedPool` objects (4 dense KV heads of head_dim 1) with that run's
per-layer geometry, 11,772 resident slots per layer, 23,040 host slots, 64-token pages, a 2 + 4
page sink/local window and 34,188 virtual pages, but ``--layers`` layers (default 4, not 32: the
tier's host work is per layer, so a step's time is about 8x what this measures).

The steps follow the scheduler: each runs every decoding sequence's next token beside one prefill
chunk (32,768 tokens less the decoders') of the first sequence still prefilling, through
:meth:`HostTier.prepare`; every 4th step (the reuse interval) fetches a selection into each layer
as the cupy backend does, ``fetch(layer, picks, streamed=True, heads=..., reads=4, flush=False)``
then one ``flush``: per decoding sequence 4 heads x 64 distinct pages of its past, each head
keeping ``--keep`` of its previous picks (a selector coming back to pages, which is what makes
missed pages enter) and drawing the rest at random. Once all are prefilled the host is full and
about 9.8k of each layer's resident pages are hot (no host copy), 2k clean.

Reports per phase the host seconds of ``prepare`` and of the selections' fetches, the pages
installed (``fetched``) and the hit rate; ``--count`` also counts the eviction policy's predicate
evaluations (``RecencyPolicy.victim``'s ``evictable`` calls; slower). ``--label`` names the run
in the JSON (``runs[label]``; other labels in the file are kept), so the same command before and
after a change of the tier leaves both.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from lserve.bench.report import header, write_labelled_run
from lserve.cache.host_tier import HostTier, SeqSpan, pinned_bound
from lserve.cache.paged_pool import PagedPool
from lserve.cache.tier_policy import RecencyPolicy

PAGE = 64  # tokens a page
RESIDENT = 753_408 // PAGE  # resident slots per layer (the run's pool of 753,408 tokens)
HOST = 23_040  # host slots (90 GiB over a page's 4 MiB in 32 layers)
SINK, LOCAL = 2, 4  # pages: 128 sink and 256 local tokens
HEADS = 4  # dense KV heads per layer
SEQS, PROMPT = 16, 131_072
BUDGET = 32_768  # max_batched_tokens
PICKS, READS = 64, 4  # pages a head picks (4096-token budget), steps a selection is read
GEOMETRY = {"resident_slots_per_layer": RESIDENT, "host_slots": HOST, "page_size": PAGE, "sink_pages": SINK,
            "local_pages": LOCAL, "dense_heads": HEADS, "seqs": SEQS, "prompt_tokens": PROMPT,
            "max_batched_tokens": BUDGET, "picks_per_head": PICKS, "reads": READS}


class CountingPolicy(RecencyPolicy):
    """:class:`RecencyPolicy` counting ``evictable`` calls (all layers together)."""

    evals = 0

    def victim(self, evictable, *args, **kwargs):
        def counted(p):
            CountingPolicy.evals += 1
            return evictable(p)
        return super().victim(counted, *args, **kwargs)


def build(layers: int, count: bool) -> tuple[HostTier, int]:
    """The tier over ``layers`` layers of tiny CPU pools, and its virtual page count."""
    pool = lambda n: PagedPool(n, HEADS, PAGE, 1, "none", torch.bfloat16, "cpu")  # noqa: E731
    virtual = RESIDENT + HOST - pinned_bound(BUDGET, SEQS, PAGE, SINK, LOCAL)
    tier = HostTier([pool(RESIDENT) for _ in range(layers)], [pool(HOST) for _ in range(layers)], virtual, PAGE,
                    SINK, LOCAL, policy=CountingPolicy if count else RecencyPolicy)
    return tier, virtual


def select(rng, layer: int, decoders: list[int], pages: list[list[int]], length: list[int], last: dict,
           keep: float) -> tuple[np.ndarray, np.ndarray]:
    """One layer's picks (virtual pages) and their heads: per decoder and head, ``PICKS`` distinct
    full pages of its past, ``keep`` of the head's previous picks among them."""
    picks, heads = [], []
    for i in decoders:
        n = (length[i] - 1) // PAGE  # full pages: the selector's candidates
        for h in range(HEADS):
            old = last.get((layer, i, h), np.zeros(0, np.int64))
            kept = old[rng.random(old.size) < keep]
            fresh = rng.choice(np.setdiff1d(np.arange(n), kept), PICKS - kept.size, replace=False)
            last[layer, i, h] = p = np.concatenate((kept, fresh))
            picks.append(np.asarray(pages[i])[p])
            heads.append(np.full(PICKS, h))
    return np.concatenate(picks), np.concatenate(heads)


def run(layers: int, decode_steps: int, keep: float, count: bool, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    tier, virtual = build(layers, count)
    free = iter(range(virtual))  # virtual pages, handed out in order (nothing is freed)
    pages: list[list[int]] = [[] for _ in range(SEQS)]
    length = [0] * SEQS
    last: dict = {}
    # per step: prepare s, fetch s (None: no selection), installed, hits, misses, victim evals, decoders
    phases: dict[str, list[tuple]] = {"prefill": [], "decode": []}
    step = 0
    while len(phases["decode"]) < decode_steps:
        decoders = [i for i in range(SEQS) if length[i] >= PROMPT]
        prefilling = next((i for i in range(SEQS) if length[i] < PROMPT), None)
        spans = []
        for i in decoders + ([] if prefilling is None else [prefilling]):
            n = 1 if i in decoders else min(BUDGET - len(decoders), PROMPT - length[i])
            while len(pages[i]) * PAGE < length[i] + n:
                pages[i].append(next(free))
            spans.append(SeqSpan(i, pages[i], length[i], length[i] + n, i in decoders))
            length[i] += n
        st0, e0 = tier.stats(), CountingPolicy.evals
        t0 = time.perf_counter()
        tier.prepare(spans)
        prepare_s = time.perf_counter() - t0
        fetch_s = None
        if decoders and step % READS == 0:  # a selection of every decoder, fetched into each layer
            fetch_s = 0.0
            for layer in range(layers):
                picks, heads = select(rng, layer, decoders, pages, length, last, keep)
                t0 = time.perf_counter()
                tier.fetch(layer, picks, streamed=True, heads=heads, reads=READS, flush=False)
                fetch_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            tier.flush()
            fetch_s += time.perf_counter() - t0
        st = tier.stats()
        phase = "prefill" if prefilling is not None else "decode"
        row = (prepare_s, fetch_s, st.fetched - st0.fetched, st.hits - st0.hits, st.misses - st0.misses,
               CountingPolicy.evals - e0, len(decoders))
        phases[phase].append(row)
        if fetch_s is not None or step % 8 == 0:
            print(f"step {step:3d} {phase:7s} decoders {len(decoders):2d} prepare {prepare_s * 1e3:8.1f} ms"
                  + (f"  fetch {fetch_s * 1e3:9.1f} ms, {row[2]:5d} installed" if fetch_s is not None else "")
                  + (f", {row[5]} victim evals" if count else ""), flush=True)
        step += 1
    tier.check()
    st = tier.stats()
    out = {"final": {"hot_pages": st.hot_pages, "pages_on_host": st.pages_on_host, "host_pages": st.host_pages,
                     "resident_slots_used": st.resident_slots_used, "resident_slots": st.resident_slots,
                     "hit_rate": round(st.hit_rate, 4), "fetched": st.fetched, "deferred": st.deferred}}
    for name, rows in phases.items():
        sel = [r for r in rows if r[1] is not None]
        fetch_s, installed = sum(r[1] for r in sel), sum(r[2] for r in sel)
        hits, misses = sum(r[3] for r in sel), sum(r[4] for r in sel)
        out[name] = {"steps": len(rows), "selections": len(sel), "prepare_s": round(sum(r[0] for r in rows), 3),
                     "fetch_s": round(fetch_s, 3), "fetch_ms_per_selection": round(1e3 * fetch_s / max(len(sel), 1), 1),
                     "installed": installed, "hit_rate": round(hits / max(hits + misses, 1), 4),
                     "fetch_us_per_install": round(1e6 * fetch_s / max(installed, 1), 1)}
        if count:
            out[name]["victim_evals"] = sum(r[5] for r in rows)
        if name == "prefill":  # the last sequence's chunks, beside all the others decoding
            tail = [r for r in rows if r[6] == SEQS - 1]
            out[name]["last_seq_host_s"] = round(sum(r[0] + (r[1] or 0.0) for r in tail), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True, help="key of this run in the JSON's runs (e.g. before, after)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--decode-steps", type=int, default=32, help="decode-only steps after the last prefill")
    ap.add_argument("--keep", type=float, default=0.5, help="share of a head's previous picks it picks again")
    ap.add_argument("--count", action="store_true", help="count the victim search's predicate evaluations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/host_tier/probe_tier_victims_cpu.json")
    a = ap.parse_args()
    t0 = time.perf_counter()
    res = run(a.layers, a.decode_steps, a.keep, a.count, a.seed)
    res = {**header(), "machine": "CPU", "torch_threads": torch.get_num_threads(), "wall_s": round(time.perf_counter() - t0, 1),
           "layers": a.layers, "decode_steps": a.decode_steps, "keep": a.keep, "seed": a.seed, **res}
    print(json.dumps(res, indent=1))
    path = write_labelled_run(a.out, "scripts/probes/probe_tier_victims.py", GEOMETRY, a.label, res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
