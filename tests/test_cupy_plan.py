"""Host tables of the CUDA backend's steps (lserve.attention.cupy_plan), on the CPU.

Small caches (page size 16, sink 32 = 2 pages, local 64 tokens = a ring of 5 local pages) whose
tables can be checked by hand; the plans come from the real step planner.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lserve.attention.chunked import streaming_prefix
from lserve.attention.cupy_plan import (
    MAX_CHUNK,
    META_FIELDS,
    PREFILL_BM,
    CupyPlanner,
    PlanGeometry,
    SplitK,
    split_units,
)
from lserve.attention.torch_backend import TorchBackend
from lserve.cache.kv_cache import KVCache
from lserve.config import CacheConfig, ModelConfig, SparsityConfig
from lserve.sparsity.plan import SeqStep

N, SINK, LOCAL = 16, 32, 64


def _setup(n_dense=(1, 2), hkv=2, G=4, budget=64, reuse=3, select_mode="kv", gq=None, dtype=torch.bfloat16,
           adaptive=""):
    """(oracle backend on the CPU: plans the steps, cupy planner over the same cache)."""
    mc = ModelConfig(vocab_size=32, hidden_size=16 * hkv * G, intermediate_size=32, num_layers=len(n_dense),
                     num_heads=hkv * G, num_kv_heads=hkv, head_dim=16)
    sp = SparsityConfig(pattern="random" if min(n_dense) < hkv else None, sink_tokens=SINK, local_tokens=LOCAL,
                        token_budget=budget, reuse_interval=reuse, select_mode=select_mode, dynamic_threshold=0,
                        select_layers="all", adaptive_budgets=adaptive)
    cc = CacheConfig(page_size=N, logical_page_size=4, num_pages=64)
    cache = KVCache(mc, cc, list(n_dense), SINK, LOCAL, 4, dtype, "cpu")
    be = TorchBackend(mc, sp, cache)
    geo = PlanGeometry.of(be, gq or min(G, 8), dtype != torch.float32)
    return be, CupyPlanner(geo)


def _step(sid, start, n, decode, first_page=0, ring0=0):
    pages = list(range(first_page, first_page + -(-(start + n) // N)))
    return SeqStep(sid, start, n, decode, pages, list(range(ring0, ring0 + 7)))


def _covered(t, e):
    """Entries each work item's units cover (chunk each, the last one the rest): must equal ``e``."""
    got = np.zeros(t.n_work, dtype=np.int64)
    for w, split in t.units.tolist():
        got[w] += max(0, min(t.chunk, e[w] - split * t.chunk))
    return got


def test_geometry_matches_the_cache():
    be, pl = _setup()
    g = pl.geometry
    assert (g.page_size, g.num_kv_heads, g.group, g.nqs, g.qmode) == (16, 2, 4, 1, False)
    assert g.ring.sink_pages == 2 and g.ring.local_pages == 5 and g.ring.num_slots == 7
    assert g.layer_kinds == ((1, True, 0), (2, True, 0)) and g.fast_prefill and g.budget_ratios == ()


def test_decode_meta_rows_page_and_ring_tables():
    be, pl = _setup(budget=0)  # no selection: every sequence reads all its pages
    # lengths 100 (7 pages, all still in the ring) and 200 (13 pages; the ring holds 0, 1, 8..12)
    plan = be.plan([_step(5, 99, 1, True, first_page=0, ring0=0), _step(6, 199, 1, True, first_page=10, ring0=7)])
    st = pl.plan(plan, split=SplitK(8, 2, "tc"))
    f = st.fields
    assert st.nb == 2 and [s.step.seq_id for s in st.dec] == [5, 6]
    assert f["tok"].tolist() == [0, 1] and f["len"].tolist() == [100, 200]
    assert f["npages"].tolist() == [7, 13] and f["nring"].tolist() == [7, 7]
    assert f["dyn"].tolist() == [0, 0] and f["kk"].tolist() == [1, 1] and st.n_sel_rows == 0
    assert st.host_table("meta").tolist() == sum((f[k].tolist() for k in META_FIELDS), [])
    pages = st.host_table("pages")
    assert pages.shape == (2, 13) and pages.dtype == np.int32
    assert pages[0].tolist() == list(range(7)) + [0] * 6 and pages[1].tolist() == list(range(10, 23))
    # ring slot r holds logical page: length 100 -> 0..6; length 200 -> 0, 1, 12, 8, 9, 10, 11
    rp, rpos = st.host_table("ring_pages"), st.host_table("ring_pos")
    assert rp.tolist() == [list(range(7)), list(range(7, 14))]
    assert rpos[0].tolist() == [16 * i for i in range(7)]
    assert rpos[1].tolist() == [16 * i for i in (0, 1, 12, 8, 9, 10, 11)]
    for b, s in enumerate(plan.seqs):  # the step planner's ring tensors say the same
        assert rp[b].tolist() == s.ring_pages.tolist() and rpos[b].tolist() == s.ring_first_pos.tolist()
    assert [n for n, _ in st.arrays] == ["meta", "pages", "ring_pages", "ring_pos", "sel_rows"]


def test_selection_rows_slots_and_reuse():
    be, pl = _setup(budget=64, reuse=3)  # K = 4 pages
    a, b = _step(0, 99, 1, True), _step(1, 49, 1, True, first_page=20)  # 7 pages (selects), 4 pages (not)
    st = pl.plan(be.plan([a, b]))
    f = st.fields
    assert f["dyn"].tolist() == [1, 0] and f["kk"].tolist() == [4, 4]
    assert f["slot"].tolist() == [0, 0] and f["nsel"].tolist() == [7, 0]
    assert st.host_table("sel_rows").tolist() == [0] and st.n_sel_rows == 1 and st.n_dynamic == 1
    assert st.sel_pages == 4 and st.max_np_sel == 7
    assert pl.slots == {0: 0} and pl.nsel == {0: 7}
    assert st.need_slots == 2 and st.need_entries == 3  # K - 1 entries per (slot, head) in kv mode
    # the next two steps reuse the selection (nsel stays at the pages of the selecting step)
    for length in (101, 117):
        a = SeqStep(0, length - 1, 1, True, list(range(-(-length // N))), list(range(7)))
        st = pl.plan(be.plan([a]))
        assert st.n_sel_rows == 0 and st.n_dynamic == 1 and st.max_np_sel == 0
        assert st.host_table("sel_rows").tolist() == [0]  # a placeholder row, never read
        assert st.fields["nsel"].tolist() == [7] and st.fields["npages"].tolist() == [-(-length // N)]
    # a released sequence's slot goes to the next one that selects
    c = _step(2, 99, 1, True, first_page=30)
    pl.plan(be.plan([c]))
    assert pl.slots == {0: 0, 2: 1}
    pl.release(0)
    be.release(0)
    st = pl.plan(be.plan([_step(3, 99, 1, True, first_page=40)]))
    assert pl.slots == {2: 1, 3: 0} and st.fields["slot"].tolist() == [0] and 0 not in pl.nsel


def test_adaptive_budget_kinds(tmp_path):
    """Per-layer ratios: each distinct ratio is a budget kind with its own meta rows (``kk``,
    ``dyn``), selecting rows and unit tables; a layer whose pages cover the sequence's pages at
    its last selection reads every page (``dyn`` 0), decided at the selection step."""
    import json

    from lserve.sparsity.adaptive_budget import ADAPTIVE_KIND

    p = tmp_path / "ratios.json"
    p.write_text(json.dumps({"kind": ADAPTIVE_KIND, "ratios": [0.5, 2.0, 0.5]}))
    be, pl = _setup(n_dense=(1, 2, 2), budget=64, reuse=3, adaptive=str(p))  # mean K = 4 pages
    g = pl.geometry
    assert g.budget_ratios == (0.5, 2.0) and [k for _, _, k in g.layer_kinds] == [1, 2, 1]
    # 7 pages: kind 1 keeps 2 and selects, kind 2 keeps 8 >= 7 and reads all; 13 pages: both select
    a, b = _step(0, 99, 1, True), _step(1, 199, 1, True, first_page=10, ring0=7)
    st = pl.plan(be.plan([a, b]), split=SplitK(8, 2, "tc"))
    assert st.fields["kk"].tolist() == [4, 4] and st.fields["dyn"].tolist() == [1, 1]
    k1, k2 = st.kind_fields(1), st.kind_fields(2)
    assert k1["kk"].tolist() == [2, 2] and k1["dyn"].tolist() == [1, 1] and st.kinds[0].sel_rows == [0, 1]
    assert k2["kk"].tolist() == [4, 8] and k2["dyn"].tolist() == [0, 1] and st.kinds[1].sel_rows == [1]
    assert (st.kinds[0].n_dynamic, st.kinds[0].sel_pages, st.kinds[1].n_dynamic, st.kinds[1].sel_pages) == (2, 4, 1, 8)
    assert st.need_entries == 7  # the largest kind's K - 1
    km = st.host_table("kind_meta")
    assert km.shape == (2, 8 * 2) and km[1].tolist() == sum((k2[f].tolist() for f in META_FIELDS), [])
    assert st.host_table("kind_sel_rows").tolist() == [[0, 1], [1, 0]]
    assert list(st.unit_tables) == [(1, True, 1, "tc"), (2, True, 2, "tc"), (2, True, 1, "tc")]
    e2 = pl.decode_entries(st, 2, True, 2).reshape(2, 2)
    assert e2[0].tolist() == [7, 7] and e2[1].tolist() == [8 - 1 + 13 - 13 + 1] * 2  # all pages / K - 1 + fresh
    # reuse steps keep the decision of the selection step, even as pages grow past the kind's K
    for length in (101, 117):
        a = SeqStep(0, length - 1, 1, True, list(range(-(-length // N))), list(range(7)))
        st = pl.plan(be.plan([a]))
        assert st.kind_fields(2)["dyn"].tolist() == [0] and st.kinds[1].sel_rows == []
        assert st.kind_fields(1)["dyn"].tolist() == [1] and st.kinds[0].sel_rows == []
    # CUDA-graph steps: per-kind bounds, and the kinds' dyn rows are part of the key
    st = pl.plan(be.plan([SeqStep(0, 117, 1, True, list(range(8)), list(range(7)))]), static=True)
    assert st.bounds is not None and len(st.bounds[0]) == 3 and st.key[-1] == ((1,), (0,))


def test_query_mode_selection_entries():
    be, pl = _setup(budget=64, select_mode="query")
    st = pl.plan(be.plan([_step(0, 99, 1, True)]))
    assert st.need_entries == 3 * 4  # (K - 1) pages per query head of the group


def test_split_units_by_hand():
    t = split_units(np.array([5, 1, 3]), ctas=4, min_chunk=2)
    assert t.chunk == 3 and (t.n_units, t.n_work, t.direct) == (4, 3, False)
    assert t.units.tolist() == [[0, 0], [0, 1], [1, 0], [2, 0]] and t.work_start.tolist() == [0, 2, 3, 4]
    t = split_units(np.array([5, 1, 3]), ctas=100, min_chunk=8)
    assert t.direct and t.chunk == 8 and t.units.tolist() == [[0, 0], [1, 0], [2, 0]]
    t = split_units(np.array([10_000]), ctas=4, min_chunk=2)
    assert t.chunk == MAX_CHUNK and t.n_units == -(-10_000 // MAX_CHUNK)


@pytest.mark.parametrize("ctas,min_chunk", [(1, 1), (3, 2), (8, 2), (64, 1), (1 << 20, 1)])
@pytest.mark.parametrize("G", [4, 5, 7, 16])
def test_units_cover_every_entry_once(ctas, min_chunk, G):
    be, pl = _setup(G=G, budget=64)
    plan = be.plan([_step(0, 99, 1, True), _step(1, 199, 1, True, first_page=10, ring0=7),
                    _step(2, 20, 1, True, first_page=30, ring0=14)])
    st = pl.plan(plan, split=SplitK(ctas, min_chunk, "cuda"))
    assert list(st.unit_tables) == [(1, True, 0, "cuda"), (2, True, 0, "cuda")]  # one per layer kind, layer order
    for (nd, selects, kind, _), t in st.unit_tables.items():
        e = pl.decode_entries(st, nd, selects, kind)
        assert e.size == t.n_work == st.nb * 2 * pl.geometry.nqs
        assert np.array_equal(_covered(t, e), e)
        ws = t.work_start
        assert ws[0] == 0 and ws[-1] == t.n_units and np.all(np.diff(ws) >= 1)
        for w in range(t.n_work):  # each work item: consecutive units, splits 0, 1, ...
            assert t.units[ws[w]: ws[w + 1], 0].tolist() == [w] * (ws[w + 1] - ws[w])
            assert t.units[ws[w]: ws[w + 1], 1].tolist() == list(range(ws[w + 1] - ws[w]))
        assert t.n_units <= ctas or t.chunk == MAX_CHUNK or t.n_units == t.n_work


def test_decode_entries_by_hand():
    be, pl = _setup(budget=64)  # K = 4
    plan = be.plan([_step(0, 99, 1, True), _step(1, 30, 1, True, first_page=10, ring0=7)])
    st = pl.plan(plan)
    # layer 0: head 0 dense, head 1 streaming. seq 0 selects: K - 1 + (7 - 7) + 1 = 4 entries;
    # seq 1 (2 pages, under the budget) reads its 2 pages; streaming heads their 7 and 2 ring pages
    assert pl.decode_entries(st, 1, True).tolist() == [4, 7, 2, 2]
    assert pl.decode_entries(st, 1, False).tolist() == [7, 7, 2, 2]  # a non-selecting layer reads all
    assert pl.decode_entries(st, 2, True).tolist() == [4, 4, 2, 2]


def _ring_slot(geo, page):
    r = geo.ring
    return page if page < r.sink_pages else r.sink_pages + (page - r.sink_pages) % r.local_pages


def test_cont_chunk_virtual_sequences():
    be, pl = _setup()
    geo = pl.geometry
    # a decode, then chunks with 200 (long past: sink + last 64) and 40 (short past: all) cached tokens
    d = _step(9, 99, 1, True, first_page=50, ring0=21)
    c1, c2 = _step(1, 200, 40, False, first_page=0, ring0=0), _step(2, 40, 20, False, first_page=20, ring0=7)
    plan = be.plan([d, c1, c2])
    st = pl.plan(plan, split=SplitK(8, 2, "tc"))
    assert [s.step.seq_id for s in st.cont] == [1, 2] and not st.fast and not st.slow
    tab = {n: a for n, a in st.arrays}
    # dense pages of each chunk's sequence, back to back
    assert st.c_page_off == [(0, 15), (15, 4)]
    assert tab["c_pages"].tolist() == list(range(15)) + list(range(20, 24))
    loc, kmap, qmap = tab["c_loc"], tab["c_kmap"], tab["c_qmap"]
    src, dst, seqs, tiles = tab["c_src"], tab["c_dst"], tab["c_seqs"], tab["c_tiles"]
    r = v = 0
    past_rows = []
    for s in st.cont:
        pos = [p for a, b in streaming_prefix(s.step.start, SINK, LOCAL) for p in range(a, b)]
        P, n = len(pos), s.t1 - s.t0
        for i, p in enumerate(pos):  # the ring (as it is before the chunk is written) still holds p
            slot = _ring_slot(geo, p // N)
            assert geo.ring.page_in_slot(s.step.start)[slot] == p // N
            assert loc[:, r + i].tolist() == [s.step.stream_pages[slot], p % N]
        past_rows.append(P)
        assert kmap[v: v + P].tolist() == list(range(r, r + P))
        assert qmap[v: v + P].tolist() == [s.t0] * P and qmap[v + P: v + P + n].tolist() == list(range(s.t0, s.t1))
        r, v = r + P, v + P + n
    assert past_rows == [SINK + LOCAL, 40]
    R = r
    # chunk rows: key row R + t (the step's own K/V after the R past rows), query row t
    v = 0
    for j, (s, P) in enumerate(zip(st.cont, past_rows)):
        n = s.t1 - s.t0
        assert kmap[v + P: v + P + n].tolist() == [R + t for t in range(s.t0, s.t1)]
        assert seqs[j].tolist() == [v, P + n]
        v += P + n
    assert loc.shape == (2, R) and kmap.size == qmap.size == v
    assert src.tolist() == list(range(96, 136)) + list(range(136 + 40, 136 + 60))
    assert dst.tolist() == list(range(1, 41)) + list(range(41, 61))
    assert tiles.tolist() == [[0, 96]] + [[1, 40]]  # tiles over the chunk rows only (40 and 20 < 64)


def test_fresh_prefill_tiles_and_fp32():
    be, pl = _setup()
    plan = be.plan([_step(0, 0, 130, False), _step(1, 0, 5, False, first_page=20, ring0=7)])
    st = pl.plan(plan)
    assert st.nb == 0 and not st.unit_tables and [n for n, _ in st.arrays] == ["seqs", "tiles"]
    assert st.host_table("seqs").tolist() == [[0, 130], [130, 5]]
    assert st.host_table("tiles").tolist() == [[0, 0], [0, PREFILL_BM], [0, 2 * PREFILL_BM], [1, 0]]
    assert st.n_tiles == 4
    be32, pl32 = _setup(dtype=torch.float32)
    st = pl32.plan(be32.plan([_step(0, 0, 130, False), _step(1, 64, 5, False, first_page=20, ring0=7)]))
    assert [s.step.seq_id for s in st.slow] == [0, 1] and not st.fast and not st.cont and not st.arrays


def test_static_tables_buckets_key_and_bounds():
    be, pl = _setup(budget=64, reuse=3)
    # 100 pages: buckets of 2 pages at this length -> stride 100; 101 -> 102
    for length, stride in ((1600, 100), (1601, 102)):
        be.release(0)
        pl.release(0)
        plan = be.plan([SeqStep(0, length - 1, 1, True, list(range(-(-length // N))), list(range(7)))], host=True)
        st = pl.plan(plan, static=True)
        assert st.host_table("pages").shape == (1, stride) and st.host_table("ring_pages").shape == (1, 7)
        assert st.key == (1, stride, 7, (1,), (4,), (0,), ()) and st.max_np_sel == stride
        fresh = -(-(3 - 1) // N) + 1  # pages appended since the last selection, at most
        assert st.bounds[0][0].tolist() == [3 + fresh + 1] and st.bounds[1].tolist() == [stride] and st.bounds[2] == 7
        assert not st.unit_tables
        # units planned for the bounds: dense heads the selection bound, streaming heads the whole ring
        t = pl.plan_units(st, SplitK(4, 1, "tc"))[(1, True, 0, "tc")]
        assert np.array_equal(_covered(t, np.array([3 + fresh + 1, 7])), [3 + fresh + 1, 7])
    # query mode, G = 4: (K - 1) * 4 + 1 = 13 entries exceed a 6-page table: no graph for this step
    be, pl = _setup(budget=64, select_mode="query")
    st = pl.plan(be.plan([_step(0, 95, 1, True)], host=True), static=True)
    assert st.bounds is None and st.key is None and not st.arrays and st.need_slots == 2


def test_pack_and_bind_on_the_cpu():
    be, pl = _setup(budget=64)
    plan = be.plan([_step(0, 99, 1, True), _step(1, 200, 40, False, first_page=20, ring0=7)])
    st = pl.plan(plan, split=SplitK(3, 1, "tc"))
    flat = st.pack(units=True)
    assert flat.dtype == np.int32
    assert flat.size == sum(a.size for _, a in st.arrays) + sum(2 * t.n_units + t.n_work + 1
                                                                 for t in st.unit_tables.values())
    dev = torch.from_numpy(flat.copy())
    st.bind(dev, units=True, gq=4, head_dim=16)
    for name, a in st.arrays:
        t = getattr(st, name)
        assert t.dtype == torch.int32 and t.shape == a.shape and np.array_equal(t.numpy(), a)
        assert t.untyped_storage().data_ptr() == dev.untyped_storage().data_ptr()  # views: one transfer
    for key, t in st.unit_tables.items():
        u = st.units[key]
        assert np.array_equal(u.units.numpy(), t.units) and np.array_equal(u.work_start.numpy(), t.work_start)
        assert (u.n_units, u.n_work, u.chunk, u.direct) == (t.n_units, t.n_work, t.chunk, t.direct)
        assert (u.part_o is None) == t.direct
        if not t.direct:
            assert u.part_o.shape == (t.n_units, 4, 16) and u.part_lse.shape == (t.n_units, 4)
    st.bind(dev[: sum(a.size for _, a in st.arrays)], units=False)  # CUDA-graph layout: no units
    assert np.array_equal(st.pages.numpy(), st.host_table("pages"))


def test_page_array_extends_in_place():
    _, pl = _setup()
    lst = list(range(10))
    s = SeqStep(0, 150, 1, True, lst)
    a = pl.page_array(s)
    assert a[:10].tolist() == lst and a.size == 10 + 64
    lst += [100, 101]
    b = pl.page_array(s)
    assert b is a and b[:12].tolist() == lst
    lst += list(range(200, 300))  # past the spare room: a bigger copy
    c = pl.page_array(s)
    assert c[: len(lst)].tolist() == lst
    other = SeqStep(0, 150, 1, True, [7, 8])  # a new list (e.g. after preemption): rebuilt
    assert pl.page_array(other)[:2].tolist() == [7, 8]
