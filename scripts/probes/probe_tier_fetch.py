"""Host time of the host KV tier around one 1M-token request (CPU model of the cupy backend's tier).

    python scripts/probes/probe_tier_fetch.py --label before|after [--layers 32] [--decode-steps 32]
        [--out benchmarks/host_tier/probe_tier_fetch_cpu.json]

Models the 1M decode rows of ``python -m lserve.bench.host_tier --contexts 1048576 --resident-tokens
524288`` (llama3-8b, INT4 KV): a :class:`HostTier` with ``mirror`` on (the cupy backend's batched
copies and device page table; on the CPU the "device" is the CPU) over tiny INT4 pools (4 dense KV
heads of head_dim 2) with that run's geometry: 8,192 resident slots a layer, 22,050 host slots,
64-token pages, a 2 + 4 page sink/local window, 32 layers. One sequence prefills 1M tokens in
32,768-token chunks through :meth:`HostTier.prepare`, then decodes; every 4th decode step (the reuse
interval) its selection is fetched into every layer by ``TierPicks.apply`` (the backend's own path:
per layer ``fetch(..., streamed=True, heads=..., reads=4, flush=False)``, then one ``flush``): per
layer 4 heads x 64 distinct full pages of its past, ``--keep`` of each head's previous picks among
them and the rest at random. The bench's random weights install ~1,000-1,100 pages a selection
over 32 layers at a hit rate of 0.505; ``--keep 0.3`` comes near (picks that come back enter as
repeats). At the end the sequence's pages are freed (:meth:`HostTier.on_free`), as the scheduler
does when it finishes.

Reports the host milliseconds of ``prepare`` (first decode step apart: it unprotects the prefilled
pages), of a selection's fetch into the 32 layers (median; on the CPU its flush's index copies move
real bytes; ``--bulk``: the cupy path, the flush builds the byte ranges one kernel copies, none here), the pages installed a selection and the hit rate, and of the
finish. On the GPU host these calls run on the engine thread between launches: with async decode a
decode step takes max(GPU, host), so a fetch longer than the GPU's step lengthens the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from lserve.attention.cupy_tier import TierPicks
from lserve.bench.report import header, write_labelled_run
from lserve.cache.host_tier import HostTier, SeqSpan
from lserve.cache.paged_pool import PagedPool

PAGE = 64
CONTEXT = 1 << 20
RESIDENT = 524_288 // PAGE  # resident slots a layer
HOST = 22_050  # host slots: 24.22 GiB over a page's 1.18 MB (INT4, 4 dense heads, 32 layers)
SINK, LOCAL = 2, 4
HEADS, PICKS, READS = 4, 64, 4
CHUNK = 32_768
GEOMETRY = {"context": CONTEXT, "resident_slots_per_layer": RESIDENT, "host_slots": HOST, "page_size": PAGE,
            "sink_pages": SINK, "local_pages": LOCAL, "dense_heads": HEADS, "picks_per_head": PICKS, "reads": READS,
            "chunk": CHUNK}


def build(layers: int, bulk: bool) -> tuple[HostTier, int]:
    pool = lambda n: PagedPool(n, HEADS, PAGE, 2, "int4", torch.bfloat16, "cpu")  # noqa: E731
    virtual = CONTEXT // PAGE + 64
    tier = HostTier([pool(RESIDENT) for _ in range(layers)], [pool(HOST) for _ in range(layers)], virtual, PAGE,
                    SINK, LOCAL, mirror=True)
    if bulk:  # the cupy path: flush builds each phase's byte ranges, one kernel moves them (not here)
        tier.use_bulk_copy(lambda ranges: None)
    return tier, virtual


def pick(rng, full: int, old: np.ndarray | None, keep: float) -> np.ndarray:
    """One head's ``PICKS`` distinct pages among ``full``: ``keep`` of its ``old`` picks, the rest new."""
    kept = old[rng.random(old.size) < keep] if old is not None else np.zeros(0, np.int64)
    fresh = rng.choice(np.setdiff1d(np.arange(full), kept), PICKS - kept.size, replace=False)
    return np.concatenate((kept, fresh))


def run(layers: int, decode_steps: int, seed: int, keep: float, bulk: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    t_build = time.perf_counter()
    tier, _ = build(layers, bulk)
    build_s = time.perf_counter() - t_build
    pages: list[int] = []
    length = 0
    t0 = time.perf_counter()
    while length < CONTEXT:  # the prefill's chunks
        n = min(CHUNK, CONTEXT - length)
        while len(pages) * PAGE < length + n:
            pages.append(len(pages))
        tier.prepare([SeqSpan(0, pages, length, length + n, False)])
        length += n
    prefill_s = time.perf_counter() - t0
    prepare_ms, fetch_ms, installed = [], [], []
    picks_state = TierPicks(tier, [(HEADS, True, 0)] * layers, READS)
    last: dict = {}
    st0 = tier.stats()
    for step in range(decode_steps):
        if len(pages) * PAGE < length + 1:
            pages.append(len(pages))
        t0 = time.perf_counter()
        tier.prepare([SeqSpan(0, pages, length, length + 1, True)])
        prepare_ms.append((time.perf_counter() - t0) * 1e3)
        length += 1
        if step % READS == 0:
            full = (length - 1) // PAGE
            before = tier.stats().fetched
            sel = []
            for layer in range(layers):  # the selection first: not the tier's time
                for h in range(HEADS):
                    last[layer, h] = pick(rng, full, last.get((layer, h)), keep)
                sel.append(np.asarray(pages)[np.concatenate([last[layer, h] for h in range(HEADS)])])
            # as the backend's selection buffers hold them: [layer, slot, head, budget] and counts
            sel_page = torch.from_numpy(np.stack(sel).reshape(layers, 1, HEADS, PICKS).astype(np.int32))
            sel_cnt = torch.full((layers, 1, HEADS), PICKS, dtype=torch.int32)
            t0 = time.perf_counter()
            picks_state.apply(sel_page, sel_cnt, [0], [[0]])  # every layer's fetch, then one flush
            fetch_ms.append((time.perf_counter() - t0) * 1e3)
            installed.append(tier.stats().fetched - before)
            print(f"decode step {step:3d}: prepare {prepare_ms[-1]:7.2f} ms, fetch {fetch_ms[-1]:7.2f} ms, "
                  f"{installed[-1]} installed", flush=True)
    tier.check()
    st = tier.stats()
    hits, misses = st.hits - st0.hits, st.misses - st0.misses
    t0 = time.perf_counter()
    tier.on_free(pages)
    tier.release(0)
    free_s = time.perf_counter() - t0
    tier.check()
    return {"build_s": round(build_s, 2), "prefill_prepare_s": round(prefill_s, 3),
            "first_decode_prepare_ms": round(prepare_ms[0], 2),
            "decode_prepare_ms_median": round(statistics.median(prepare_ms[1:]), 3),
            "fetch_ms_median": round(statistics.median(fetch_ms), 2), "fetch_ms": [round(x, 2) for x in fetch_ms],
            "installed_per_selection": installed, "hit_rate": round(hits / max(hits + misses, 1), 4),
            "deferred": st.deferred, "on_free_ms": round(free_s * 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True, help="key of this run in the JSON's runs (e.g. before, after)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--keep", type=float, default=0.3, help="share of a head's previous picks it picks again")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bulk", action="store_true",
                    help="the cupy path's flush: byte ranges built, no copies made (the GPU kernel's part)")
    ap.add_argument("--out", default="benchmarks/host_tier/probe_tier_fetch_cpu.json")
    a = ap.parse_args()
    t0 = time.perf_counter()
    res = run(a.layers, a.decode_steps, a.seed, a.keep, a.bulk)
    res = {**header(), "machine": "CPU", "wall_s": round(time.perf_counter() - t0, 1), "layers": a.layers,
           "decode_steps": a.decode_steps, "keep": a.keep, "seed": a.seed, "bulk": a.bulk, **res}
    print(json.dumps({k: v for k, v in res.items() if k != "fetch_ms"}, indent=1))
    path = write_labelled_run(a.out, "scripts/probes/probe_tier_fetch.py", GEOMETRY, a.label, res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
