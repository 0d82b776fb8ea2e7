"""The unified block-sparse prefill kernel against its torch oracle (fresh random inputs, output
poisoned with NaN): groups 1/4/5/7/8, head dims 64/128, page sizes 16/32/64, ragged lengths, chunks
with cached past, dense and streaming heads in one launch, block lists and every block kept; every
tile-shape variant of ``lserve.bench.bsp_prefill.VARIANTS`` (v1 mma.sync, v2 wgmma, v3 warp-specialized
"ws"/"wsp"/"wsi", v4 "v4_s2"/"v4_s3" (128 keys a step, Q in shared memory), v5 "v5_s3" (v3 with the
pool's K/V by TMA) and "v5p_s3" (v5 on a persistent grid, also with one or a few CTAs per head);
all but v1 head dim 128 only). v5 also: its other ring depths, pages of 8, 16
and 128 keys (TMA boxes of 8, 16 and 64 keys, the last at in-page row 0 or 64) and 48 (no tensor map:
cp.async), with the pool rows past the sequence poisoned with NaN (a partial block must be zero-filled),
and its tensor maps encoded by the driver once per pool."""

import pytest
import torch

from lserve.attention import paged_prefill as bsp
from lserve.bench.bsp_prefill import LOCAL, SINK, TOL, VARIANTS, parity, shuffled_pages
from lserve.sparsity.prefill_blocks import fixed_fraction_blocks

pytestmark = pytest.mark.gpu


def _need_sm90(variant) -> None:
    if variant.impl != "mma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup MMA kernel: sm_90 only")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_bsp_prefill_matches_reference(variant, seed):
    _need_sm90(variant)
    cases = parity((variant,), seed)
    bad = [(c["case"], c["max_rel_err"]) for c in cases if not c["ok"]]
    assert len(cases) == (8 if variant.supports(64) else 6) and not bad, f"max rel err above {TOL}: {bad}"


@pytest.mark.parametrize("variant", [bsp.TileShape(bsp.V5, 1, 8, stages=s) for s in (2, 4)], ids=lambda v: v.name)
def test_v5_other_ring_depths_match_reference(variant, seed):
    _need_sm90(variant)
    cases = parity((variant,), seed)
    bad = [(c["case"], c["max_rel_err"]) for c in cases if not c["ok"]]
    assert len(cases) == 6 and not bad, f"max rel err above {TOL}: {bad}"


@pytest.mark.parametrize("sms", [1, 5])
def test_v5_persistent_ctas_loop_over_many_tiles(sms, seed, monkeypatch):
    """The persistent v5 ("v5p_s3") with the SM count faked to 1 or 5: a CTA or a few per head run
    every tile of the launch through one K/V ring (stages and phases carried across tiles, the
    producer a tile ahead), on every parity case: block lists, every block kept, partial last
    blocks by cp.async, streaming heads, chunks with a past."""
    shape = bsp.TileShape(bsp.V5, 1, 8, stages=3, persist=True)
    _need_sm90(shape)
    monkeypatch.setattr(bsp, "_num_sms", lambda device: sms)
    cases = parity((shape,), seed)
    bad = [(c["case"], c["max_rel_err"]) for c in cases if not c["ok"]]
    assert len(cases) == 6 and not bad, f"max rel err above {TOL}: {bad}"


@pytest.mark.parametrize("page", [8, 16, 128, 48])
def test_v5_pool_blocks_by_tma_and_a_poisoned_partial_block(page, seed):
    shape = bsp.TileShape(bsp.V5, 1, 8)
    _need_sm90(shape)
    gen = torch.Generator().manual_seed(seed)
    g, hkv, nd, d = 4, 3, 2, 128
    # dense listed + streaming heads from position 0; a chunk after 640 cached keys, every block kept
    for start, n, frac in ((0, 1001, 0.5), (640, 517, None)):
        L = start + n
        q = torch.randn(n, hkv * g, d, generator=gen).to("cuda", torch.bfloat16)
        k = torch.randn(L, hkv, d, generator=gen).to("cuda", torch.bfloat16)
        v = torch.randn(L, hkv, d, generator=gen).to("cuda", torch.bfloat16)
        pool, pages = shuffled_pages(k, v, nd, page, gen)
        assert L % page and L % bsp.BN  # the last page and the last block are partial
        for x in pool:  # rows past the sequence: a block copied without zero fill turns P V into NaN
            x[int(pages[(L - 1) // page]), :, L % page:] = float("nan")
        assert (bsp.tma_maps(*pool) is None) == (page == 48)
        blocks = fixed_fraction_blocks(nd, start, L, frac, bsp.BN, 256, seed) if frac is not None else None
        p = bsp.plan([bsp.PrefillSeq(0, start, n, 0, blocks)], g, nd, "cuda", shape)
        out = torch.full_like(q, float("nan"))
        heads = hkv if start == 0 else nd  # streaming heads need start 0
        scale = d ** -0.5
        bsp.run(q, k[start:], v[start:], out, p, nd, 0, heads, scale, SINK, LOCAL if start == 0 else 0, pool,
                pages.cuda())
        torch.cuda.synchronize()
        ref = bsp.reference(q, k, v, start, nd, scale, blocks, SINK, LOCAL)[:, : heads * g]
        got = out[:, : heads * g].float()
        assert not got.isnan().any(), f"page {page}, start {start}: NaN in the output"
        err = float((got - ref).abs().max() / ref.abs().max())
        assert err < TOL, f"page {page}, start {start}: max rel err {err}"


def test_v5_tensor_maps_are_encoded_once_per_pool():
    from lserve.kernels.tensor_map import MAP_BYTES, pool_tensor_maps

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("tensor maps: sm_90+")
    pk = torch.zeros(10, 2, 64, 128, dtype=torch.bfloat16, device="cuda")
    pv = torch.zeros_like(pk)
    a = pool_tensor_maps(pk, pv, bsp.BN)
    assert pool_tensor_maps(pk, pv, bsp.BN) is a  # cached
    assert a.numel() == 2 * MAP_BYTES and a.device == pk.device and bool(a.any())
    assert not torch.equal(a[:MAP_BYTES], a[MAP_BYTES:])  # K's and V's: other addresses
    b = pool_tensor_maps(pk[:5], pv[:5], bsp.BN)  # same addresses, fewer pages: another map
    assert b is not a and not torch.equal(a, b)
