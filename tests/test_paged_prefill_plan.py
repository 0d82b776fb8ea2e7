"""Host side of the unified block-sparse prefill kernel: the tile plan and the torch oracle."""

import pytest
import torch

from lserve.attention import paged_prefill as bsp
from lserve.attention.block_sparse_prefill import blocked_prefill
from lserve.sparsity.prefill_blocks import fixed_fraction_blocks


def test_tiles_cover_each_query_once_inside_rows_heaviest_first():
    a = fixed_fraction_blocks(2, 700, 3000, 0.4, bsp.BN, 512, seed=1)
    seqs = [bsp.PrefillSeq(0, 700, 2300, 0, a), bsp.PrefillSeq(2300, 0, 1000, 40, None)]
    p = bsp.plan(seqs, group=7, n_dense=2, device="cpu")
    npos = bsp.MMA.rows // 7
    tiles = p.tiles.tolist()
    assert [t[2] for t in tiles] == sorted((t[2] for t in tiles), reverse=True)
    for i, s in enumerate(seqs):
        mine = sorted(t for t in tiles if t[0] == i)
        covered = [x for t in mine for x in range(t[1], t[2])]
        assert covered == list(range(s.start, s.start + s.n_new))
        assert all(0 < t[2] - t[1] <= npos for t in mine)
        if s.blocks is not None:  # inside one 512-position row, whose list row it names
            assert all(t[1] // 512 == (t[2] - 1) // 512 and t[3] == t[1] // 512 - 700 // 512 for t in mine)
        else:
            assert all(t[3] == -1 for t in mine)
    assert p.seqs.tolist() == [[0, 700, 2300, 0], [2300, 0, 1000, 40]]
    # each (head, list row) points at that row's kept blocks in the concatenated indices
    for h in range(2):
        for r in range(a.n_rows):
            lo, hi = p.rowptr[h, r].tolist()
            assert torch.equal(p.indices[lo:hi], a.row(h, r))


def test_plan_refuses_a_list_of_another_chunk():
    b = fixed_fraction_blocks(2, 0, 1000, 0.5, bsp.BN, 256)
    with pytest.raises(ValueError, match="does not match the chunk"):
        bsp.plan([bsp.PrefillSeq(0, 0, 999, 0, b)], 4, 2, "cpu")
    with pytest.raises(ValueError, match="does not fit"):
        bsp.plan([bsp.PrefillSeq(0, 0, 10, 0, None)], bsp.MMA.rows + 1, 1, "cpu")


def test_reference_is_blocked_prefill_on_dense_heads_and_the_window_on_streaming():
    torch.manual_seed(0)
    g, hkv, nd, d, start, n = 3, 3, 2, 16, 300, 400
    L = start + n
    q, k, v = torch.randn(n, hkv * g, d), torch.randn(L, hkv, d), torch.randn(L, hkv, d)
    blocks = fixed_fraction_blocks(nd, start, L, 0.4, bsp.BN, 128, seed=2)
    out = bsp.reference(q, k, v, start, nd, 0.25, blocks, sink=64, local=100)
    want = blocked_prefill(q[:, : nd * g].transpose(0, 1), k[:, :nd].transpose(0, 1), v[:, :nd].transpose(0, 1),
                           blocks, 0.25).transpose(0, 1)
    assert torch.allclose(out[:, : nd * g], want, atol=1e-5)
    # streaming head: position p sees keys t <= p with t < 64 or p - t < 100
    p, hq = start + 250, nd * g  # a query of the streaming head's first query head
    keys = [t for t in range(p + 1) if t < 64 or p - t < 100]
    s = (k[keys, nd] @ q[250, hq]) * 0.25
    assert torch.allclose(out[250, hq], torch.softmax(s, 0) @ v[keys, nd], atol=1e-5)
    # every block kept = causal attention
    full = bsp.reference(q, k, v, start, nd, 0.25, None)
    sd = torch.nn.functional.scaled_dot_product_attention(
        q[:, :g].transpose(0, 1)[None], k[:, :1].transpose(0, 1)[None], v[:, :1].transpose(0, 1)[None],
        attn_mask=torch.arange(L)[None, :] <= torch.arange(start, L)[:, None], scale=0.25)[0]
    assert torch.allclose(full[:, :g], sd.transpose(0, 1), atol=1e-5)


def test_fixed_fraction_blocks_keep_what_they_say():
    b = fixed_fraction_blocks(3, 0, 32768, 0.2, 64, 2048, seed=3)
    assert abs(b.kept_fraction() - 0.2) < 0.02
    for r in range(b.n_rows):
        rows = [b.row(h, r).tolist() for h in range(3)]
        assert len({len(x) for x in rows}) == 1  # same count per head (the gathered path needs it)
        rs, re = b.row_span(r)
        for x in rows:
            assert x == sorted(set(x)) and x[0] == 0 and x[-1] == (re - 1) // 64
            assert set(range(max(0, rs // 64 - 1), (re - 1) // 64 + 1)) <= set(x)


def test_warp_specialized_shapes_name_their_kernel_and_refuse_head_dim_64():
    ws, wsi = bsp.TileShape("ws", 1, 8), bsp.TileShape("wsi", 1, 8, stages=4)
    assert (ws.rows, ws.threads, ws.name, wsi.name) == (128, 384, "ws_s3", "wsi_s4")
    assert bsp.MMA.threads == 128 and bsp.MMA.name == "mma_mt2_w4"
    v = ws.variant("bf16", 128)
    assert v.family == "bsp_prefill_ws" and v.tuning == ("LS_BSP_SWIZZLE=1", "LS_BSP_PINGPONG=0", "LS_BSP_STAGES=3")
    assert wsi.variant("fp16", 128).tuning == ("LS_BSP_SWIZZLE=0", "LS_BSP_PINGPONG=0", "LS_BSP_STAGES=4")
    assert bsp.TileShape("wsp", 1, 8).variant("bf16", 128).tuning[:2] == ("LS_BSP_SWIZZLE=1", "LS_BSP_PINGPONG=1")
    # the ring, the Q staging and the barriers within the 227 KiB a Hopper CTA may use
    assert ws.smem_bytes(128) == 1024 + 3 * 32768 + 128 * 136 * 2 + 48 and wsi.smem_bytes(128) <= 227 * 1024
    for shape in (ws, bsp.TileShape("wg", 1, 8)):
        assert not shape.supports(64)
        with pytest.raises(ValueError, match="head_dim 128 only"):
            shape.variant("bf16", 64)
    for bad in (dict(impl="ws", mt=2, warps=8), dict(impl="ws", mt=1, warps=4), dict(impl="ws", mt=1, warps=8, stages=5),
                dict(impl="xx", mt=1, warps=8)):
        with pytest.raises(ValueError, match="bad tile shape"):
            bsp.TileShape(**bad)
    # a tile of the warp-specialized kernel holds 128 // group positions
    p = bsp.plan([bsp.PrefillSeq(0, 0, 1000, 0, None)], 7, 1, "cpu", ws)
    assert max(t[2] - t[1] for t in p.tiles.tolist()) == 128 // 7 and p.shape is ws


def test_v4_shapes_name_their_kernel_and_fit_shared_memory():
    v2, v3 = bsp.TileShape("v4", 1, 8, stages=2), bsp.TileShape("v4", 1, 8, stages=3)
    assert (v2.rows, v2.threads, v2.name, v3.name) == (128, 384, "v4_s2", "v4_s3")
    var = v3.variant("fp16", 128)
    assert (var.family, var.dtype, var.tuning) == ("bsp_prefill_ws4", "fp16", ("LS_BSP_STAGES=3",))
    # stages of 128 keys of K and V, the swizzled Q tile, four mbarriers a stage; three stages still fit 227 KiB
    assert v2.smem_bytes(128) == 1024 + 2 * 65536 + 32768 + 64
    assert v3.smem_bytes(128) == 1024 + 3 * 65536 + 32768 + 96 <= 227 * 1024
    assert not v2.supports(64)
    with pytest.raises(ValueError, match="head_dim 128 only"):
        v2.variant("bf16", 64)
    for bad in (dict(stages=4), dict(stages=1), dict(warps=4), dict(mt=2)):
        with pytest.raises(ValueError, match="bad tile shape"):
            bsp.TileShape(**{"impl": "v4", "mt": 1, "warps": 8, **bad})
    assert bsp.default_shape(128, (9, 0)).impl == "v5"  # v4 measured slower than v3 and v5
    p = bsp.plan([bsp.PrefillSeq(0, 0, 1000, 0, None)], 4, 1, "cpu", v2)
    assert max(t[2] - t[1] for t in p.tiles.tolist()) == 32 and p.shape is v2


def test_ablations_are_timing_studies_of_ws_only(capsys):
    """Each ablation names what it leaves out, builds ``ws`` with its LS_BSP_ABLATE, exists only for
    ``ws``; the bench never parity-checks one nor runs its kept-fraction rows with it."""
    from lserve.bench import bsp_prefill as bench

    for a, what in bsp.ABLATIONS.items():
        shape = bsp.TileShape("ws", 1, 8, ablate=a)
        assert shape.name == f"ws_s3_{what}" and bench.SHAPES[shape.name] == shape
        assert shape.variant("bf16", 128).tuning[-1] == f"LS_BSP_ABLATE={a}"
    assert bsp.WS.variant("bf16", 128).tuning == ("LS_BSP_SWIZZLE=1", "LS_BSP_PINGPONG=0", "LS_BSP_STAGES=3")
    for bad in (dict(impl="ws", ablate=9), dict(impl="wsi", ablate=1), dict(impl="v4", stages=2, ablate=1)):
        with pytest.raises(ValueError, match="bad tile shape"):
            bsp.TileShape(mt=1, warps=8, **bad)
    assert bench.parity((bsp.TileShape("ws", 1, 8, ablate=2),)) == []  # no GPU touched: nothing to check
    with pytest.raises(SystemExit):
        bench.main(["out", "--variants", "ws_s3_noload", "ws_s3_nopv"])
    assert "not a timing study" in capsys.readouterr().err


def test_v5_shapes_name_their_kernel_fit_shared_memory_and_v5_s3_is_the_hopper_default():
    shapes = [bsp.TileShape("v5", 1, 8, stages=s) for s in (2, 3, 4)]
    assert [(s.rows, s.threads, s.name) for s in shapes] == [(128, 384, f"v5_s{n}") for n in (2, 3, 4)]
    assert all(s.warp_specialized for s in shapes)
    for s in shapes:
        var = s.variant("fp16", 128)
        assert (var.family, var.dtype, var.tuning) == ("bsp_prefill_v5", "fp16", (f"LS_BSP_STAGES={s.stages}",))
        # v3's layout: the ring, the Q staging and two mbarriers a stage, within the 227 KiB of a Hopper CTA
        ws = bsp.TileShape("ws", 1, 8, stages=s.stages)
        assert s.smem_bytes(128) == ws.smem_bytes(128) == 1024 + s.stages * 32768 + 128 * 136 * 2 + 16 * s.stages
        assert s.smem_bytes(128) <= 227 * 1024
    assert not shapes[0].supports(64)
    with pytest.raises(ValueError, match="head_dim 128 only"):
        shapes[0].variant("bf16", 64)
    for bad in (dict(stages=1), dict(stages=5), dict(warps=4), dict(mt=2), dict(ablate=1)):
        with pytest.raises(ValueError, match="bad tile shape"):
            bsp.TileShape(**{"impl": "v5", "mt": 1, "warps": 8, **bad})
    # measured fastest on the H200 (bsp_prefill_study_h200.json); elsewhere and at head dim 64 the mma kernel
    assert bsp.default_shape(128, (9, 0)) == bsp.TMA == shapes[1]
    assert bsp.default_shape(64, (9, 0)) == bsp.default_shape(128, (8, 0)) == bsp.MMA
    assert bsp.MEASURED_RATE[bsp.default_shape(128, (9, 0)).impl] > bsp.MEASURED_RATE["ws"]
    p = bsp.plan([bsp.PrefillSeq(0, 0, 1000, 0, None)], 8, 1, "cpu", shapes[1])
    assert max(t[2] - t[1] for t in p.tiles.tolist()) == 16 and p.shape is shapes[1]


def test_v5_tensor_maps_only_for_contiguous_pools_whose_pages_tile_a_block(monkeypatch):
    """``tma_maps``: None without a pool or for pages TMA boxes do not tile (the kernel then copies
    with cp.async), a refusal for a strided pool, else the maps of both pools (encoding faked: no driver)."""
    from lserve.kernels import tensor_map

    seen = []

    def fake(pk, pv, block):
        seen.append((tuple(pk.shape), block))
        return "maps"

    monkeypatch.setattr(tensor_map, "pool_tensor_maps", fake)
    assert bsp.tma_maps(None, None) is None
    for page in (4, 24, 48, 96):
        pk = torch.zeros(3, 2, page, 128, dtype=torch.bfloat16)
        assert bsp.tma_maps(pk, pk.clone()) is None
    for page in (8, 16, 32, 64, 128, 256):
        pk = torch.zeros(3, 2, page, 128, dtype=torch.bfloat16)
        assert bsp.tma_maps(pk, pk.clone()) == "maps"
    assert seen == [((3, 2, p, 128), bsp.BN) for p in (8, 16, 32, 64, 128, 256)]
    strided = torch.zeros(3, 2, 64, 256, dtype=torch.bfloat16)[..., :128]
    with pytest.raises(ValueError, match="contiguous"):
        bsp.tma_maps(strided, strided)


def test_the_persistent_v5_shape_builds_its_own_binary_and_launches_about_one_wave(monkeypatch):
    """``persist`` ("v5p_s3"): v5 with LS_BSP_PERSIST=1, about one CTA per SM split over the launch's
    heads (never more CTAs than tiles), the tile count passed after the tensor maps; the plain v5
    launches a CTA per tile. Launches captured (no GPU)."""
    from lserve.kernels import loader

    v5p = bsp.TileShape(bsp.V5, 1, 8, stages=3, persist=True)
    assert v5p.name == "v5p_s3" and v5p.threads == bsp.TMA.threads and v5p.smem_bytes(128) == bsp.TMA.smem_bytes(128)
    assert v5p.variant("bf16", 128).tuning == ("LS_BSP_STAGES=3", "LS_BSP_PERSIST=1")
    for impl in ("mma", "ws", bsp.V4):
        with pytest.raises(ValueError, match="bad tile shape"):
            bsp.TileShape(impl, 1, 8, persist=True)
    launches = []
    monkeypatch.setattr(bsp, "kernel", lambda shape, dtype, d: shape.name)
    monkeypatch.setattr(bsp, "_num_sms", lambda device: 132)
    monkeypatch.setattr(bsp, "tma_maps", lambda pk, pv: None)
    monkeypatch.setattr(loader, "launch", lambda kern, grid, block, args, shared_mem=0: launches.append((kern, grid, args)))
    q = torch.zeros(3000, 8, 128, dtype=torch.bfloat16)
    for shape, n_heads in ((v5p, 4), (v5p, 1), (bsp.TMA, 4)):
        p = bsp.plan([bsp.PrefillSeq(0, 0, 3000, 0, None)], 4, 2, "cpu", shape)
        bsp.run(q, q[:, :2], q[:, :2], q.clone(), p, 2, 0, n_heads, 0.1)
        kern, grid, args = launches[-1]
        assert kern == shape.name and int(args[-1]) == p.n_tiles == -(-3000 // 32)
        assert grid == ((33 if n_heads == 4 else min(132, p.n_tiles)) if shape.persist else p.n_tiles, n_heads)


def test_prompts_up_to_the_bound_chunk_on_the_paged_kernel_longer_ones_on_the_grid():
    # Served on the H100: paged chunks 3% faster at 32k, 0.8% slower at 128k (the cuDNN grid).
    from types import SimpleNamespace

    from lserve.attention.chunked import CUDNN_MIN_TOKENS
    from lserve.attention.cupy_backend import CupyBackend

    def backend(paged: bool):
        be = SimpleNamespace(paged_chunks=paged, chunk_grid=2048)
        be.paged_prompt = lambda n: CupyBackend.paged_prompt(be, n)
        return be

    bound = bsp.PAGED_CHUNKS_MAX_PROMPT
    assert bsp.PAGED_DENSE_CHUNKS and CUDNN_MIN_TOKENS <= 32768 < bound < 131072
    on, off = backend(True), backend(False)
    assert [on.paged_prompt(n) for n in (0, 32768, bound, bound + 1, 131072)] == [False, True, True, False, False]
    assert not off.paged_prompt(32768)
    # no grid where the paged kernel runs the chunks (chunk edges anywhere); the grid past the bound
    assert CupyBackend.chunk_align(on, 32768) == 0 and CupyBackend.chunk_align(on, 131072) == 2048
    assert CupyBackend.chunk_align(off, 32768) == 2048
