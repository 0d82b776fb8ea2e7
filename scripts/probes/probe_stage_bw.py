"""How fast the GPU reads the host KV tier's mapped host pool, by how it reads it (GPU only).

    python scripts/probes/probe_stage_bw.py [--gib 2] [--mib 512] [--out benchmarks/host_tier/probe_stage_bw_h100.json]

A selecting step of the tier stages the head parts of its picks on the host (``ls_stage_picks``,
``kernels/stage.cu``): kernel loads of mapped pinned memory, one CTA per 16 KB part (bf16, 64-token
pages, head_dim 128: a head's K or V part). At 128k bf16 with 16 sequences that is ~1.8 GB a
selection, and the served figure is bounded by how fast it moves. This times ``--mib`` MiB read from
a ``--gib`` GiB host pool (``lserve.cache.host_memory.mapped_pair``) into a device buffer:

* ``kernel_16k``: ``ls_page_copy`` (the same loads as the stage kernel) over random 16 KB parts;
* ``kernel_1m``: ``ls_page_copy`` over random 1 MiB ranges (the same bytes in larger pieces);
* ``dma_contiguous``: one copy-engine copy of a contiguous range of the pool's CPU twin;
* ``dma_1m``: one copy-engine copy per random 1 MiB range (``torch`` ``copy_`` each);
* ``dma_16k``: one copy-engine copy per random 16 KB part (a 16th of the bytes: per-copy cost);
* ``kernel_16k_d2d``: ``ls_page_copy`` over random 16 KB parts of a device pool (the ceiling).

Each is timed with CUDA events after a warm-up, the median of 5 runs, and reported in GB/s.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from lserve.attention.cupy_tier import bulk_copy
from lserve.bench.kernels import median_events
from lserve.bench.report import header, write_json
from lserve.cache.host_memory import mapped_pair

PART = 16 * 1024
BIG = 1 << 20


def _time(fn, runs: int = 5) -> float:
    """Median seconds of ``fn()`` (CUDA events, after a warm-up)."""
    return median_events(fn, runs, warmup=1) / 1e3


def _ranges(src_base: int, dst_base: int, n_src: int, n: int, size: int, rng) -> np.ndarray:
    """``n`` random distinct ``size``-byte pieces of a ``n_src``-piece source, to consecutive targets."""
    pick = rng.choice(n_src, size=n, replace=False).astype(np.int64)
    return np.stack((src_base + pick * size, dst_base + np.arange(n, dtype=np.int64) * size,
                     np.full(n, size // 16, dtype=np.int64)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="host pool size")
    p.add_argument("--mib", type=int, default=512, help="bytes moved per timed run")
    p.add_argument("--out", default="benchmarks/host_tier/probe_stage_bw.json")
    a = p.parse_args(argv)
    dev = torch.device("cuda", torch.cuda.current_device())
    rng = np.random.default_rng(0)
    pool_bytes = int(a.gib * 2**30) // BIG * BIG
    nbytes = a.mib << 20
    host, twin = mapped_pair((pool_bytes,), torch.uint8, dev)
    twin.view(torch.int32).random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    src_dev = torch.empty(pool_bytes // 4, dtype=torch.uint8, device=dev).view(torch.int32).random_().view(torch.uint8)
    out = {}

    def kernel(base: int, n_src: int, size: int, n: int) -> float:
        r = _ranges(base, dst.data_ptr(), n_src, n, size, rng)
        return n * size / _time(lambda: bulk_copy(r)) / 1e9

    out["kernel_16k"] = kernel(host.data_ptr(), pool_bytes // PART, PART, nbytes // PART)
    out["kernel_1m"] = kernel(host.data_ptr(), pool_bytes // BIG, BIG, nbytes // BIG)
    out["kernel_16k_d2d"] = kernel(src_dev.data_ptr(), src_dev.numel() // PART, PART, nbytes // PART)
    pieces = _ranges(host.data_ptr(), dst.data_ptr(), pool_bytes // PART, 64, PART, rng)
    bulk_copy(pieces)  # checked once: the 16 KB pieces land where the table says
    torch.cuda.synchronize()
    for j, s in enumerate(((pieces[0] - host.data_ptr()) // PART).tolist()):
        assert torch.equal(dst[j * PART:(j + 1) * PART].cpu(), twin[s * PART:(s + 1) * PART]), "copy mismatch"
    out["dma_contiguous"] = nbytes / _time(lambda: dst.copy_(twin[:nbytes], non_blocking=True)) / 1e9
    big = rng.choice(pool_bytes // BIG, size=nbytes // BIG, replace=False).tolist()

    def dma(starts, size):
        for j, s in enumerate(starts):
            dst[j * size:(j + 1) * size].copy_(twin[s * size:(s + 1) * size], non_blocking=True)
    out["dma_1m"] = nbytes / _time(lambda: dma(big, BIG)) / 1e9
    small = rng.choice(pool_bytes // PART, size=nbytes // PART // 16, replace=False).tolist()
    out["dma_16k"] = len(small) * PART / _time(lambda: dma(small, PART)) / 1e9
    report = {**header(), "probe": "stage_bw", "pool_gib": a.gib, "mib_per_run": a.mib,
              "gb_per_s": {k: round(v, 2) for k, v in out.items()}}
    write_json(a.out, report)
    print(json.dumps(report["gb_per_s"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
