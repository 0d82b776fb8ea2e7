"""Plan once, run many: ``CupyBackend.plan`` builds every table of a step before its layers run.

No GPU here: a stand-in of the cupy backend whose cache lives on the CPU (device check and SM
count overridden, PDL off) plans and uploads real tables; no kernel is launched. The tables a
plan carries must be exactly those the step's planner builds for the same generic plans (eager,
CUDA-graph and the eager fallback of a graph step), and the per-layer budget must be decided by
one rule on both backends and in the KV-read meter. tests/gpu/test_backend_parity.py and
tests/gpu/test_cuda_graphs.py run the same paths with the kernels.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lserve.attention.cupy_backend import CupyBackend
from lserve.attention.cupy_plan import CupyPlanner, CupyStep
from lserve.attention.torch_backend import TorchBackend
from lserve.cache.kv_cache import KVCache
from lserve.config import CacheConfig, ModelConfig, SparsityConfig
from lserve.sparsity.adaptive_budget import ADAPTIVE_KIND, layer_pages
from lserve.sparsity.kv_read import KVReadMeter, ring_tokens, selected_tokens, step_read
from lserve.sparsity.plan import SeqStep, StepPlanner, layer_budget

N = 16


class CpuCupy(CupyBackend):
    """The cupy backend over a CPU cache: plans and uploads, never launches."""

    def _check_device(self) -> None:
        pass

    def _num_sms(self) -> int:
        return 132


def _backends(monkeypatch, tmp_path, ratios=None, mode="kv", budget=64, reuse=3, n_dense=(1, 2, 2)):
    """(cupy stand-in, torch oracle) over one CPU cache, a planner each."""
    monkeypatch.setenv("LSERVE_PDL", "0")
    mc = ModelConfig(vocab_size=32, hidden_size=64 * 2 * 4, intermediate_size=32, num_layers=len(n_dense),
                     num_heads=8, num_kv_heads=2, head_dim=64)
    adaptive = ""
    if ratios is not None:
        p = tmp_path / "ratios.json"
        p.write_text(json.dumps({"kind": ADAPTIVE_KIND, "ratios": list(ratios)}))
        adaptive = str(p)
    sp = SparsityConfig(pattern="random", sink_tokens=32, local_tokens=64, token_budget=budget, reuse_interval=reuse,
                        select_mode=mode, dynamic_threshold=0, select_layers="all", adaptive_budgets=adaptive)
    cc = CacheConfig(page_size=N, logical_page_size=4, num_pages=512)
    cache = KVCache(mc, cc, list(n_dense), 32, 64, 8, torch.bfloat16, "cpu")
    return CpuCupy(mc, sp, cache), TorchBackend(mc, sp, cache)


def _twin(be: CupyBackend) -> tuple[StepPlanner, CupyPlanner]:
    """A second step planner and table planner with the backend's config: fed the same steps,
    they build the tables the backend's plan() must carry."""
    sp = StepPlanner(be.sp, be.cache, be.planner.device)
    sp.selects = be.planner.selects
    return sp, CupyPlanner(be.table_planner.geometry)


def _same_host(a: CupyStep, b: CupyStep, units: bool = True) -> None:
    assert [n for n, _ in a.arrays] == [n for n, _ in b.arrays]
    for (_, x), (_, y) in zip(a.arrays, b.arrays):
        assert x.dtype == y.dtype == np.int32 and np.array_equal(x, y)
    assert (a.nb, a.n_sel_rows, a.n_dynamic, a.sel_pages, a.max_np_sel, a.need_slots, a.need_entries, a.key) == \
           (b.nb, b.n_sel_rows, b.n_dynamic, b.sel_pages, b.max_np_sel, b.need_slots, b.need_entries, b.key)
    if not units:
        return
    assert list(a.unit_tables) == list(b.unit_tables)
    for k, t in a.unit_tables.items():
        u = b.unit_tables[k]
        assert (t.n_units, t.chunk, t.direct) == (u.n_units, u.chunk, u.direct)
        assert np.array_equal(t.units, u.units) and np.array_equal(t.work_start, u.work_start)


def _uploaded_once(st: CupyStep) -> None:
    """Every device field equals its host table, and all of them (units included) view one buffer."""
    storages = set()
    for name, a in st.arrays:
        t = getattr(st, name)
        assert t.dtype == torch.int32 and np.array_equal(t.numpy(), a)
        storages.add(t.untyped_storage().data_ptr())
    for key, u in st.units.items():
        t = st.unit_tables[key]
        assert np.array_equal(u.units.numpy(), t.units) and np.array_equal(u.work_start.numpy(), t.work_start)
        storages.add(u.units.untyped_storage().data_ptr())
    assert len(storages) <= 1
    if st.cont:  # the int64 copies the chunk paths index with, made by plan() too
        assert torch.equal(st.c_pages_long, st.c_pages.long())
        assert all(torch.equal(x, y.long()) for x, y in zip(st.c_long, (st.c_loc, st.c_kmap, st.c_qmap, st.c_src,
                                                                         st.c_dst)))


def _script(sid_len: dict[int, int]):
    """Steps of a run: two fresh prefills, two chunks with cached past, then decodes (some steps
    with a chunk next to them), a sequence released and a new one arriving."""
    lens = dict(sid_len)
    pages = {i: list(range(i * 100, i * 100 + 100)) for i in range(8)}
    ring = {i: list(range(i * 7, i * 7 + 7)) for i in range(8)}

    def step(i, n, decode, start=None):
        return SeqStep(i, lens[i] - n if start is None else start, n, decode, pages[i], ring[i])

    yield "eager", [step(0, 300, False, 0), step(1, 45, False, 0)], None
    yield "eager", [step(2, 29, False, 1000), step(3, 17, False, 500)], None
    for k in range(24):
        for i in lens:
            lens[i] += 1
        dec = [step(i, 1, True) for i in sorted(lens)]
        if k % 7 == 3:
            yield "eager", dec[:2] + [step(2, 30, False, lens[2] - 30)], None
        else:
            yield ("graph" if k % 2 else "eager"), dec, None
        if k == 12:
            del lens[1]
            lens[5] = 700
            yield "release", [], 1


@pytest.mark.parametrize("ratios,mode", [(None, "kv"), ((0.5, 2.0, 20.0), "kv"), ((0.3, 1.0, 3.0), "query")])
def test_plan_carries_the_tables_of_the_step(monkeypatch, tmp_path, ratios, mode):
    """Eager steps: plan().tables are the planner's tables for the step (split-K units of every
    layer kind included), uploaded in one transfer. Graph steps: the capturable tables (views of
    the static buffer, ``packed`` to upload), their key's units at capture, and on the eager
    fallback the eager tables of the same step. The twin sees every step in the same order."""
    be, _ = _backends(monkeypatch, tmp_path, ratios, mode)
    tw_steps, tw_tables = _twin(be)
    seen_graph = fallback = 0
    for kind, steps, released in _script({0: 300, 1: 45, 2: 1029, 3: 517}):
        if kind == "release":
            be.release(released)
            tw_steps.release(released)
            tw_tables.release(released)
            continue
        ref = tw_steps.plan(steps, host=kind == "graph")
        if kind == "eager":
            plan = be.plan(steps)
            want = tw_tables.plan(ref, split=be.split_k())
            _same_host(plan.tables, want)
            _uploaded_once(plan.tables)
            dec = [s for s in plan.seqs if s.step.decode]
            assert len(plan.tables.dec) == len(dec) and all(x is y for x, y in zip(plan.tables.dec, dec))
            continue
        plan = be.plan(steps, host=True)
        want = tw_tables.plan(ref, static=True)
        st = plan.tables
        if want.bounds is None:  # past the bounds: no graph, the eager fallback
            assert st is None
        else:
            seen_graph += 1
            _same_host(st, want, units=False)  # a captured key's units come with it (below)
            assert np.array_equal(st.packed, want.pack(units=False))
            for name, _ in st.arrays:  # views of the static buffer the engine fills
                assert getattr(st, name).untyped_storage().data_ptr() == be.static_buffer.untyped_storage().data_ptr()
            if seen_graph % 2:  # captured: the key's units, planned for its bounds
                be.graph_units(st)
                want_units = tw_tables.plan_units(want, be.split_k())
                assert list(st.unit_tables) == list(want_units)
                for k, t in want_units.items():
                    assert np.array_equal(st.unit_tables[k].units, t.units)
                continue
        fallback += 1
        eager = be.eager_plan(plan, "cpu")
        want = tw_tables.plan(ref.to("cpu"), split=be.split_k())
        assert eager.tables is not plan.tables and eager.tables.key is None
        moved = [s for s in eager.seqs if s.step.decode]  # the tables of the plan the layers run
        assert len(eager.tables.dec) == len(moved) and all(x is y for x, y in zip(eager.tables.dec, moved))
        _same_host(eager.tables, want)
        _uploaded_once(eager.tables)
    assert fallback and (seen_graph or mode == "query")


def test_graph_units_are_fixed_per_key(monkeypatch, tmp_path):
    """A key's units are planned once (at its capture) and every later step with that key gets
    the same device buffers, which a captured graph keeps reading."""
    be, _ = _backends(monkeypatch, tmp_path, budget=256, reuse=8)
    pages, ring = list(range(100)), list(range(7))
    first, a, b = (be.plan([SeqStep(0, n - 1, 1, True, pages, ring)], host=True).tables for n in (1000, 1001, 1002))
    assert first.n_sel_rows == 1 and first.key != a.key  # the selecting step has a graph of its own
    assert a.key == b.key and not a.units and not b.units
    be.graph_units(a)
    assert a.units and set(a.units) == set(a.unit_tables)
    again = be.plan([SeqStep(0, 1002, 1, True, pages, ring)], host=True).tables
    assert again.key == a.key and again.units is a.units
    with pytest.raises(ValueError, match="not a CUDA-graph step"):
        be.graph_units(be.plan([SeqStep(0, 1003, 1, True, pages, ring)]).tables)


def test_mixed_host_step_has_no_graph_tables(monkeypatch, tmp_path):
    be, _ = _backends(monkeypatch, tmp_path)
    plan = be.plan([SeqStep(0, 99, 1, True, list(range(7)), list(range(7))),
                    SeqStep(1, 0, 20, False, list(range(10, 12)), list(range(7, 14)))], host=True)
    assert plan.tables is None
    eager = be.eager_plan(plan, "cpu")
    assert isinstance(eager.tables, CupyStep) and eager.tables.nb == 1 and len(eager.tables.fast) == 1
    assert plan.to("cpu").tables is None  # a moved plan drops tables built for the other form


def test_attend_only_launches_with_the_plans_tables(monkeypatch, tmp_path):
    """attend builds nothing: a plan without tables, or a graph step's tables outside a
    capture, is refused before anything is written."""
    be, _ = _backends(monkeypatch, tmp_path)
    steps = [SeqStep(0, 99, 1, True, list(range(7)), list(range(7)))]
    q = torch.zeros(1, 8, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    bare = be.planner.plan(steps)
    with pytest.raises(ValueError, match=r"plan the step with this backend's plan\(\)"):
        be.attend(0, q, k, k.clone(), bare, torch.empty_like(q))
    graph = be.plan([SeqStep(0, 100, 1, True, list(range(7)), list(range(7)))], host=True)
    assert graph.tables is not None and not graph.tables.units
    with pytest.raises(ValueError, match="eager_plan"):
        be.attend(0, q, k, k.clone(), graph, torch.empty_like(q))


def test_layer_budget_rule_by_hand():
    # ratio 2 of K = 4 pages keeps 8: selection while the sequence had more than 8 pages at it
    assert layer_budget(2.0, 4, 13, N) == 8 and layer_budget(2.0, 4, 8, N) == 0 and layer_budget(2.0, 4, 7, N) == 0
    assert layer_budget(None, 4, 7, N) == 4 and layer_budget(0.3, 4, 7, N) == 1  # 19 tokens: one page, at least
    for ratio in (None, 0.01, 0.3, 0.5, 1.0, 2.0, 20.0):
        for k in range(1, 9):
            for at in range(1, 60):
                kp = layer_pages(ratio, k, N)
                assert layer_budget(ratio, k, at, N) == (kp if kp < at else 0)


@pytest.mark.parametrize("mode", ["kv", "query"])
def test_one_budget_per_layer_on_both_backends_and_the_meter(monkeypatch, tmp_path, mode):
    """Per layer and decode sequence, through selection and reuse steps as pages grow past a
    layer's budget: the torch backend's selections, the cupy tables' budget kinds and the
    KV-read meter all follow ``AttentionBackend.layer_budget``."""
    be, ref = _backends(monkeypatch, tmp_path, (0.5, 2.0, 20.0), mode, budget=64, reuse=3)
    hq, hkv, D = be.model.num_heads, be.hkv, be.D
    gen = torch.Generator().manual_seed(0)
    lens = {0: 100, 1: 118, 2: 400}
    pages = {i: list(range(i * 60, i * 60 + 60)) for i in lens}
    ring = {i: list(range(i * 7, i * 7 + 7)) for i in lens}
    meter = KVReadMeter()
    group = be.group if mode == "query" else 1
    checked = set()
    for _ in range(9):
        steps = [SeqStep(i, lens[i], 1, True, pages[i], ring[i]) for i in sorted(lens)]
        plan_t, st = ref.plan(steps), be.plan(steps).tables
        meter.begin_step()
        for b, (sp_t, sp_c) in enumerate(zip(plan_t.seqs, st.dec)):
            per_layer = []
            for layer in range(be.model.num_layers):
                kp = ref.layer_budget(layer, sp_t)
                assert kp == be.layer_budget(layer, sp_c)
                f = st.kind_fields(be.budget_kind[layer])
                assert kp == (int(f["kk"][b]) if f["dyn"][b] else 0)  # the cupy tables' decision
                checked.add((layer, kp > 0))
                per_layer.append(selected_tokens(sp_t.length, N, kp, sp_t.pages_at_select, group) if kp else None)
            stream = ring_tokens(be.cache.ring.page_in_slot(sp_t.length), sp_t.length, N)
            meter.add(sp_t.step.seq_id, *step_read(be.cache.n_dense, hkv, sp_t.length, stream, per_layer))
        for layer in range(be.model.num_layers):  # the oracle selects exactly where the rule says
            q = torch.randn(len(steps), hq, D, generator=gen).to(torch.bfloat16)
            kv = torch.randn(len(steps), hkv, D, generator=gen).to(torch.bfloat16)
            before = {sid for sid in ref.selection[layer]}
            ref.run(layer, q, kv, kv.clone(), plan_t)
            for sp_t in plan_t.seqs:
                kp = ref.layer_budget(layer, sp_t)
                sid = sp_t.step.seq_id
                if kp and sp_t.select:
                    assert ref.selection[layer][sid][0].shape[1] == kp - 1
                elif not kp:
                    assert (sid in ref.selection[layer]) == (sid in before)
        for i in lens:
            lens[i] += 1
    assert ref.kv_read.total == meter.total == be.kv_read.total
    assert {(0, True), (1, True), (1, False), (2, False)} <= checked  # both decisions, and layers that differ
