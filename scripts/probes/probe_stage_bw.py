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
* ``kernel_16k_d2d``: ``ls_page_copy`` over random 16 KB parts of a device pool (the ceiling);
* ``stage_T_U``: ``ls_stage_picks`` itself (built with ``ST_THREADS=T``, ``ST_UNROLL=U``) on the
  128k bf16 concurrency run's geometry: 16 sequences x 4 dense heads x 63 picks, ``--miss`` of
  them on the host (K and V: two 16 KB parts a pick), the rest resident; bytes of the staged
  parts over its time, its staged bytes checked against the host pool once;
* ``copy_same_parts``: ``ls_page_copy`` over exactly those parts (what the stage kernel could reach).

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


def stage_kernel(host: torch.Tensor, twin: torch.Tensor, miss: float, rng, dev) -> dict:
    """``ls_stage_picks`` variants and ``ls_page_copy`` over the same parts (module docstring)."""
    from lserve.kernels.loader import Variant, get_kernel, i32, launch, ptr

    S, H, U, N, D = 16, 4, 63, 64, 128  # sequences, dense heads, picks, page tokens, head_dim
    page = H * N * D * 2  # bytes of a bf16 page of one tensor
    n_host = host.numel() // (2 * page)  # K pool, then V pool, in the mapped buffer
    k_host, v_host = host[: n_host * page], host[n_host * page: 2 * n_host * page]
    base = 1024  # resident slots before the staging area
    res = torch.zeros(2, base + S * U, page, dtype=torch.uint8, device=dev)
    virtual = S * H * U
    on_host = torch.from_numpy(rng.random(virtual) < miss)
    slot = torch.empty(virtual, dtype=torch.int32)
    host_slots = torch.from_numpy(rng.choice(n_host, size=virtual, replace=False).astype(np.int32))
    slot[on_host] = -1 - host_slots[on_host]
    slot[~on_host] = torch.from_numpy(rng.integers(0, base, size=virtual).astype(np.int32))[~on_host]
    slot = slot.to(dev)
    sel_page = torch.arange(virtual, dtype=torch.int32, device=dev).view(S, H, U)  # each pick its own page
    sel_cnt = torch.full((S, H), U, dtype=torch.int32, device=dev)
    stage = torch.full((S, H, U), -2, dtype=torch.int32, device=dev)
    meta = torch.zeros(8, S, dtype=torch.int32)
    meta[5] = torch.arange(S)  # META_SLOT (kernels/decode_meta.cuh)
    meta, rows = meta.to(dev), torch.arange(S, dtype=torch.int32, device=dev)
    tier = torch.tensor([slot.data_ptr(), k_host.data_ptr(), v_host.data_ptr(), 0, 0, 0, 0, stage.data_ptr()],
                        dtype=torch.int64, device=dev)
    bases = torch.tensor([[k_host.data_ptr(), v_host.data_ptr()], [res[0].data_ptr(), res[1].data_ptr()],
                          [page, page]], dtype=torch.int64, device=dev)
    parts = int(on_host.sum()) * 2 * (page // H)  # bytes staged a launch
    counted = torch.zeros(1, dtype=torch.int64, device=dev)  # the kernel's count of picks staged
    out = {}
    for threads, unroll in ((128, 8), (256, 4), (256, 8), (512, 2)):
        kern = get_kernel(Variant("stage", "bf16", D, tuning=(f"ST_THREADS={threads}", f"ST_UNROLL={unroll}")),
                          "ls_stage_picks")
        args = (ptr(meta), i32(S), ptr(rows), i32(H), ptr(sel_page), ptr(sel_cnt), ptr(stage), i32(H * U), i32(U),
                i32(H), ptr(tier), ptr(bases), i32(2), i32(base), i32(S), i32(U), ptr(counted))
        run = lambda k=kern, t=threads, x=args: launch(k, (S, H, U), (t,), x)  # noqa: E731
        out[f"stage_{threads}_{unroll}"] = parts / _time(run) / 1e9
    assert counted.item() % int(on_host.sum()) == 0 and counted.item() > 0, "staged count"
    st = stage.cpu()
    hs = host_slots.view(S, H, U)
    for s_, h, e in rng.integers(0, [S, H, U], size=(32, 3)).tolist():
        staged = on_host.view(S, H, U)[s_, h, e].item()
        assert st[s_, h, e].item() == (base + s_ * U + e if staged else -1), "stage map"
        if staged:
            part = slice(h * page // H, (h + 1) * page // H)
            for t, pool in enumerate((k_host, v_host)):
                want = pool[hs[s_, h, e].item() * page:][part].cpu()
                assert torch.equal(res[t, base + s_ * U + e, part].cpu(), want), "staged bytes"
    # the same parts through ls_page_copy
    idx = on_host.view(S, H, U).nonzero()
    src = [(pool.data_ptr() + hs[s_, h, e].item() * page + h * (page // H)) for s_, h, e in idx.tolist()
           for pool in (k_host, v_host)]
    dst = [(res[t].data_ptr() + (base + s_ * U + e) * page + h * (page // H)) for s_, h, e in idx.tolist()
           for t in (0, 1)]
    r = np.stack((np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64),
                  np.full(len(src), page // H // 16, dtype=np.int64)))
    out["copy_same_parts"] = parts / _time(lambda: bulk_copy(r)) / 1e9
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="host pool size")
    p.add_argument("--mib", type=int, default=512, help="bytes moved per timed run")
    p.add_argument("--miss", type=float, default=0.46, help="share of the staged picks on the host")
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
    out.update(stage_kernel(host, twin, a.miss, rng, dev))
    report = {**header(), "probe": "stage_bw", "pool_gib": a.gib, "mib_per_run": a.mib, "miss": a.miss,
              "gb_per_s": {k: round(v, 2) for k, v in out.items()}}
    write_json(a.out, report)
    print(json.dumps(report["gb_per_s"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
