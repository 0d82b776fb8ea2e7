"""TorchBackend against a slow, independently written masked-dense reference.

The reference in this file re-derives the attention semantics from the spec (SPEC.md sections
2-4) in float64 with explicit masks, and does not use ``lserve.sparsity.selector`` or any
backend helper:

* KV heads ``[0, n_dense)`` of a layer are dense, the rest streaming; query head ``h`` reads
  KV head ``h // G``.
* Prefill chunk: query at position ``p`` attends to keys ``t <= p``, cached (dequantized) keys
  for ``t < start`` and the chunk's fresh keys otherwise; streaming heads also need
  ``t < sink`` or ``p - t < local``.
* Decode: the new token is stored first, everything is read back from the (dequantized) cache.
  Dense heads of layers ``>= dense_layers`` with dynamic selection active (budget > 0,
  length >= threshold, pages > K = budget // page_size) read only the selected physical pages:
  top (K-1) of all but the last page by ``max_j sum_i max(q_i kmax_ji, q_i kmin_ji)`` over the
  page's logical pages (statistics of the raw keys), plus the last page; per query head
  (``"query"``) or per KV head with the max over its group (``"kv"``).
* Reuse interval C: selection runs at decode step ``s`` if nothing is stored or
  ``s - s_last >= C``; otherwise the stored pages plus every page from the then-last page on.

Every step of every scenario compares all layers' outputs with relative error <= 1e-4
(quantized caches: against the reference built on the same dequantized values).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from lserve.attention.torch_backend import TorchBackend
from lserve.cache.kv_cache import KVCache
from lserve.cache.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from lserve.config import CacheConfig, ModelConfig, SparsityConfig
from lserve.sparsity.plan import SeqStep

TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Thousands of tiny ops: intra-op threads only add contention on a small, shared CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
def stored(x: torch.Tensor, kv_quant: str) -> torch.Tensor:
    """What the cache gives back for float32 ``x`` [T, H, D] (float64)."""
    if kv_quant == "none":
        return x.double()
    if kv_quant == "int8":
        return dequantize_int8(*quantize_int8(x), torch.float32).double()
    return dequantize_int4(*quantize_int4(x), torch.float32).double()


def masked_softmax_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """q [Q, D], k/v [L, D], allowed bool [Q, L] (float64) -> [Q, D]."""
    logits = (q @ k.T) * scale
    logits = torch.where(allowed, logits, torch.full_like(logits, float("-inf")))
    w = torch.softmax(logits, dim=-1)
    return w @ v


@dataclass
class RefConfig:
    G: int
    n_dense: list[int]
    page: int
    lpage: int
    kv_quant: str
    sink: int
    local: int
    budget: int
    reuse: int
    threshold: int
    dense_layers: int
    mode: str
    scale: float


@dataclass
class RefSeq:
    k_raw: list[torch.Tensor]  # per layer: raw keys [T, H_kv, D] float32 (for the page statistics)
    k_st: list[torch.Tensor]  # per layer: stored (dequantized) keys [T, H_kv, D] float64
    v_st: list[torch.Tensor]
    budget: int
    decode_count: int = 0
    last_select: int | None = None
    # layer -> (per query head: set of physical page indices chosen excluding the then-last page,
    #           number of pages at selection time)
    selection: dict[int, tuple[list[set[int]], int]] = field(default_factory=dict)


class Reference:
    """Slow masked-dense model of the two-way cache and the sparse attention."""

    def __init__(self, cfg: RefConfig, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.c = cfg
        self.num_layers, self.hkv, self.d = num_layers, num_kv_heads, head_dim
        self.seqs: dict[int, RefSeq] = {}
        self.log: list[dict] = []  # per step: {seq_id: info}

    def add(self, seq_id: int, budget: int) -> None:
        def empty(dtype):
            return [torch.zeros(0, self.hkv, self.d, dtype=dtype) for _ in range(self.num_layers)]
        self.seqs[seq_id] = RefSeq(empty(torch.float32), empty(torch.float64), empty(torch.float64), budget)

    def drop(self, seq_id: int) -> None:
        del self.seqs[seq_id]

    # -- per-step schedule ---------------------------------------------------------------------
    def begin_step(self, entries: list[tuple[int, int, bool]]) -> None:
        c = self.c
        self.entries = entries
        self.info: dict[int, dict] = {}
        for sid, n, dec in entries:
            s = self.seqs[sid]
            start = s.k_raw[0].shape[0]
            length = start + n
            n_pages = -(-length // c.page)
            K = s.budget // c.page
            dynamic = dec and s.budget > 0 and length >= c.threshold and n_pages > K
            select = False
            if dec:
                step = s.decode_count
                s.decode_count += 1
                if dynamic:
                    select = s.last_select is None or step - s.last_select >= c.reuse
                    if select:
                        s.last_select = step
                else:
                    s.last_select = None
                    s.selection.clear()
            self.info[sid] = dict(start=start, length=length, n_pages=n_pages, K=K, dynamic=dynamic,
                                  select=select, decode=dec, pages_read={})
        self.log.append(self.info)

    # -- selection -----------------------------------------------------------------------------
    def page_scores(self, s: RefSeq, layer: int, q: torch.Tensor, kv: int, n_pages: int) -> list[float]:
        """Physical page scores of pages [0, n_pages - 1) for one query head q [D] and KV head kv."""
        c = self.c
        g = c.page // c.lpage
        n_full = n_pages - 1  # every page but the last is full
        keys = s.k_raw[layer][: n_full * c.page, kv].double()  # raw keys, [T, D]
        by_logical = keys.reshape(n_full * g, c.lpage, -1)  # logical page j = tokens [j*N_L, (j+1)*N_L)
        kmax, kmin = by_logical.max(dim=1).values, by_logical.min(dim=1).values  # [n_full*g, D]
        s_logical = torch.maximum(q * kmax, q * kmin).sum(dim=-1)  # [n_full*g]
        out = []
        for p in range(n_full):
            out.append(max(float(s_logical[p * g + j]) for j in range(g)))
        return out

    def select_pages(self, s: RefSeq, layer: int, q: torch.Tensor, n_pages: int, K: int) -> list[set[int]]:
        """Per dense query head: the top K-1 pages among all but the last."""
        c = self.c
        nd = c.n_dense[layer]
        per_q = [self.page_scores(s, layer, q[h], h // c.G, n_pages) for h in range(nd * c.G)]
        chosen = []
        for h in range(nd * c.G):
            if c.mode == "kv":
                grp = range((h // c.G) * c.G, (h // c.G + 1) * c.G)
                sc = [max(per_q[j][p] for j in grp) for p in range(n_pages - 1)]
            else:
                sc = per_q[h]
            order = sorted(range(n_pages - 1), key=lambda p: -sc[p])
            chosen.append(set(order[: K - 1]))
        return chosen

    # -- attention -----------------------------------------------------------------------------
    def layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] float32 -> [T, Hq, D] float64."""
        out = torch.zeros(q.shape, dtype=torch.float64)
        t0 = 0
        for sid, n, dec in self.entries:
            s, info = self.seqs[sid], self.info[sid]
            qs, ks, vs = q[t0:t0 + n].double(), k[t0:t0 + n], v[t0:t0 + n]
            if dec:
                self._append(s, layer, ks, vs)
                out[t0] = self._decode(s, layer, qs[0], info)
            else:
                out[t0:t0 + n] = self._prefill(s, layer, qs, ks, vs, info["start"])
                self._append(s, layer, ks, vs)
            t0 += n
        return out

    def _append(self, s: RefSeq, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        s.k_raw[layer] = torch.cat((s.k_raw[layer], k))
        s.k_st[layer] = torch.cat((s.k_st[layer], stored(k, self.c.kv_quant)))
        s.v_st[layer] = torch.cat((s.v_st[layer], stored(v, self.c.kv_quant)))

    def _stream_ok(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Λ mask: causal and (sink or local), elementwise over broadcast positions."""
        return (t <= p) & ((t < self.c.sink) | (p - t < self.c.local))

    def _prefill(self, s: RefSeq, layer: int, q, k, v, start: int) -> torch.Tensor:
        c = self.c
        n = q.shape[0]
        nd = c.n_dense[layer]
        keys = torch.cat((s.k_st[layer][:start], k.double()))  # cached past + fresh chunk
        vals = torch.cat((s.v_st[layer][:start], v.double()))
        p = torch.arange(start, start + n)[:, None]
        t = torch.arange(start + n)[None, :]
        out = torch.zeros(q.shape, dtype=torch.float64)
        for h in range(q.shape[1]):
            kv = h // c.G
            allowed = (t <= p) if kv < nd else self._stream_ok(p, t)
            out[:, h] = masked_softmax_attend(q[:, h], keys[:, kv], vals[:, kv], allowed, c.scale)
        return out

    def _decode(self, s: RefSeq, layer: int, q: torch.Tensor, info: dict) -> torch.Tensor:
        c = self.c
        nd = c.n_dense[layer]
        L = info["length"]
        p = torch.tensor(L - 1)
        t = torch.arange(L)
        n_pages = info["n_pages"]
        sparse = info["dynamic"] and layer >= c.dense_layers and nd > 0
        if sparse:
            if info["select"] or layer not in s.selection:
                s.selection[layer] = (self.select_pages(s, layer, q, n_pages, info["K"]), n_pages)
            chosen, n_at = s.selection[layer]
            read = [ch | set(range(n_at - 1, n_pages)) for ch in chosen]
            info["pages_read"][layer] = read
        keys, vals = s.k_st[layer], s.v_st[layer]  # everything from the cache, incl. this token
        out = torch.zeros(q.shape, dtype=torch.float64)
        for h in range(q.shape[0]):
            kv = h // c.G
            if kv >= nd:
                allowed = self._stream_ok(p, t)
            elif sparse:
                allowed = torch.tensor([(i // c.page) in read[h] for i in range(L)])
            else:
                allowed = torch.ones(L, dtype=torch.bool)
            out[h] = masked_softmax_attend(q[h:h + 1], keys[:, kv], vals[:, kv], allowed[None], c.scale)[0]
        return out


# ----------------------------------------------------------------------------------------------
# Harness: drives the real cache + backend and the reference(s) with the same random tensors
# ----------------------------------------------------------------------------------------------
@dataclass
class _Seq:
    pages: list[int]
    ring: list[int]
    length: int = 0
    budget: int | None = None


class Harness:
    """One KVCache + TorchBackend and one or more references fed identical q/k/v."""

    def __init__(self, *, heads=(4, 2), head_dim=16, n_dense=(1, 1), page=8, lpage=4, kv_quant="none",
                 sink=8, local=16, budget=24, reuse=1, threshold=0, dense_layers=0, mode="kv", seed=0,
                 num_pages=128, max_seqs=4, extra_reuse=(), check=True) -> None:
        hq, hkv = heads
        self.model = ModelConfig(vocab_size=32, hidden_size=hq * head_dim, intermediate_size=32,
                                 num_layers=len(n_dense), num_heads=hq, num_kv_heads=hkv, head_dim=head_dim)
        self.sp = SparsityConfig(pattern="random", sink_tokens=sink, local_tokens=local, token_budget=budget,
                                 reuse_interval=reuse, dynamic_threshold=threshold, dense_layers=dense_layers,
                                 select_mode=mode)
        cc = CacheConfig(page_size=page, logical_page_size=lpage, num_pages=num_pages, kv_quant=kv_quant)
        self.cache = KVCache(self.model, cc, list(n_dense), sink, local, max_seqs, torch.float32, "cpu")
        self.backend = TorchBackend(self.model, self.sp, self.cache)
        base = RefConfig(G=hq // hkv, n_dense=list(n_dense), page=page, lpage=lpage, kv_quant=kv_quant,
                         sink=sink, local=local, budget=budget, reuse=reuse, threshold=threshold,
                         dense_layers=dense_layers, mode=mode, scale=head_dim ** -0.5)
        self.refs = [Reference(base, len(n_dense), hkv, head_dim)]
        for c in extra_reuse:
            self.refs.append(Reference(RefConfig(**{**base.__dict__, "reuse": c}), len(n_dense), hkv, head_dim))
        self.gen = torch.Generator().manual_seed(seed)
        self.seqs: dict[int, _Seq] = {}
        self.budget = budget
        self.check = check
        self.errors: list[float] = []
        self.other_diffs: list[list[float]] = [[] for _ in self.refs[1:]]
        self.outputs: list[list[torch.Tensor]] = []

    @property
    def ref(self) -> Reference:
        return self.refs[0]

    def add(self, seq_id: int, budget: int | None = None) -> None:
        ring = self.cache.stream_alloc.allocate(self.cache.stream_pages_per_seq)
        self.seqs[seq_id] = _Seq([], ring, budget=budget)
        for r in self.refs:
            r.add(seq_id, self.budget if budget is None else budget)

    def finish(self, seq_id: int) -> None:
        s = self.seqs.pop(seq_id)
        self.cache.dense_alloc.free(s.pages)
        self.cache.stream_alloc.free(s.ring)
        self.backend.release(seq_id)
        for r in self.refs:
            r.drop(seq_id)

    def step(self, entries: list[tuple[int, int, bool]]) -> list[torch.Tensor]:
        steps = []
        for sid, n, dec in entries:
            s = self.seqs[sid]
            assert not dec or n == 1
            need = self.cache.pages_for(s.length + n)
            if need > len(s.pages):
                s.pages += self.cache.dense_alloc.allocate(need - len(s.pages))
            steps.append(SeqStep(sid, s.length, n, dec, list(s.pages), list(s.ring), token_budget=s.budget))
            s.length += n
        plan = self.backend.plan(steps)
        for r in self.refs:
            r.begin_step(entries)
        for sp in plan.seqs:  # the plan's schedule must be the spec's schedule
            info = self.ref.info[sp.step.seq_id]
            assert sp.dynamic == info["dynamic"], (sp.step.seq_id, sp.length)
            if sp.dynamic:
                assert sp.select == info["select"], (sp.step.seq_id, sp.length)
        T, hq, hkv, d = plan.num_tokens, self.model.num_heads, self.model.num_kv_heads, self.model.head_dim
        outs = []
        for layer in range(self.model.num_layers):
            q = torch.randn(T, hq, d, generator=self.gen)
            k = torch.randn(T, hkv, d, generator=self.gen)
            v = torch.randn(T, hkv, d, generator=self.gen)
            out = self.backend.run(layer, q, k, v, plan)
            assert out.shape == q.shape and out.dtype == torch.float32
            ref = self.ref.layer(layer, q, k, v)
            err = rel_err(out, ref)
            self.errors.append(err)
            if self.check:
                assert err <= TOL, f"layer {layer} entries {entries}: rel err {err:.3g}"
            for i, r in enumerate(self.refs[1:]):
                self.other_diffs[i].append(rel_err(out, r.layer(layer, q, k, v)))
            outs.append(out)
        self.outputs.append(outs)
        return outs

    # -- common schedules ------------------------------------------------------------------------
    def prefill(self, seq_id: int, chunks: list[int]) -> None:
        for n in chunks:
            self.step([(seq_id, n, False)])

    def decode(self, seq_ids: list[int], steps: int) -> None:
        for _ in range(steps):
            self.step([(sid, 1, True) for sid in seq_ids])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max())


def selections(ref: Reference, seq_id: int, layer: int) -> list[tuple]:
    """Per decode step of a sequence (where layer was sparse): pages read per query head."""
    out = []
    for info in ref.log:
        i = info.get(seq_id)
        if i is not None and layer in i["pages_read"]:
            out.append(tuple(frozenset(s) for s in i["pages_read"][layer]))
    return out


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------
GQA = [(4, 4), (6, 2), (8, 2), (10, 2), (7, 1), (8, 1), (16, 1)]  # G = 1, 3, 4, 5, 7, 8, 16


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"G{h[0] // h[1]}")
@pytest.mark.parametrize("mode", ["kv", "query"])
def test_gqa_streaming_and_selection(heads, mode):
    """Prefill in uneven chunks, long decode: streaming ring wraps, dense heads select pages."""
    hkv = heads[1]
    n_dense = (hkv - hkv // 2, hkv // 2)  # layer 1 of the 1-KV-head model is all streaming
    h = Harness(heads=heads, n_dense=n_dense, mode=mode, seed=hkv * 10 + heads[0], budget=24, reuse=1)
    h.add(0)
    h.prefill(0, [13, 20])  # 33 tokens: second chunk crosses the 32-token ring (1 sink + 3 local pages)
    h.decode([0], 40)  # to 73 tokens: 10 pages, K = 3
    assert len(selections(h.ref, 0, 0)) == 40


@pytest.mark.parametrize("kv_quant", ["none", "int8", "int4"])
def test_mixed_batch_many_sequences(kv_quant):
    """Several sequences of odd lengths in one step, prefill chunks mixed with decodes, a per-request
    budget, a finished sequence whose pages are reused by a new one."""
    h = Harness(heads=(6, 2), n_dense=(1, 2, 0), kv_quant=kv_quant, sink=8, local=8, budget=24, reuse=2,
                seed=7, head_dim=32, lpage=2)
    h.add(0)
    h.add(1, budget=16)
    h.step([(0, 19, False), (1, 5, False)])
    h.step([(0, 1, True), (1, 26, False)])
    h.add(2)
    for i in range(12):
        entries = [(0, 1, True), (1, 1, True)]
        if i < 3:
            entries.insert(1, (2, 11, False))
        else:
            entries.append((2, 1, True))
        h.step(entries)
    h.finish(1)
    h.add(3)  # takes over seq 1's freed pages (stale data, stale statistics)
    h.step([(3, 21, False), (0, 1, True), (2, 1, True)])
    h.step([(0, 1, True), (3, 17, False), (2, 1, True)])
    h.decode([2, 3, 0], 10)
    assert max(h.errors) <= TOL
    for sid in (0, 2, 3):  # dynamic selection really happened for every long sequence
        assert selections(h.ref, sid, 1)
    assert not selections(h.ref, 0, 2)  # layer 2 has no dense heads


@pytest.mark.parametrize("mode", ["kv", "query"])
def test_per_request_budget(mode):
    """SeqStep.token_budget overrides the configured budget per sequence in one batch:
    K = 1 (only the last page), K = 2, 0 (selection off) and the default (K = 3)."""
    h = Harness(heads=(6, 2), n_dense=(2, 1), budget=24, reuse=2, seed=29, mode=mode)
    budgets = {0: 8, 1: 16, 2: 0, 3: None}
    for sid, b in budgets.items():
        h.add(sid, budget=b)
    h.step([(0, 25, False), (1, 31, False), (2, 17, False), (3, 35, False)])
    h.decode([0, 1, 2, 3], 12)
    for sid, b in budgets.items():
        sel = selections(h.ref, sid, 0)
        assert bool(sel) == (b != 0)
    assert all(len(s[0]) == 1 for s in selections(h.ref, 0, 0)[::2])  # selecting steps: last page only


@pytest.mark.parametrize("kv_quant", ["int8", "int4"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["G1", "G4"])
def test_quantized_cache(kv_quant, heads):
    """INT8/INT4 storage: reference reads the same dequantized values (stats from raw keys)."""
    h = Harness(heads=heads, n_dense=(heads[1] // 2, heads[1] - 1), kv_quant=kv_quant, seed=3, budget=16,
                reuse=3, mode="query", lpage=2)
    h.add(0)
    h.add(1)
    h.step([(0, 27, False), (1, 9, False)])
    h.step([(0, 1, True), (1, 14, False)])
    h.decode([0, 1], 25)
    # Sanity: quantization actually changes the output (the test is not vacuous).
    h2 = Harness(heads=heads, n_dense=(heads[1] // 2, heads[1] - 1), seed=3, budget=16, reuse=3, mode="query",
                 lpage=2, check=False)
    h2.add(0)
    h2.add(1)
    h2.step([(0, 27, False), (1, 9, False)])
    h2.step([(0, 1, True), (1, 14, False)])
    h2.decode([0, 1], 25)
    diff = max(rel_err(a, b.double()) for s1, s2 in zip(h.outputs, h2.outputs) for a, b in zip(s1, s2))
    assert diff > 1e-3


@pytest.mark.parametrize("sink,local", [(0, 8), (8, 16), (16, 8)])
def test_streaming_ring_wraparound(sink, local):
    """All-streaming layer: the ring wraps many times in decode, and a chunked prefill crosses it."""
    h = Harness(heads=(4, 2), n_dense=(0, 1), sink=sink, local=local, budget=0, seed=11 + sink + local)
    h.add(0)
    h.add(1)
    h.step([(0, 3, False), (1, 45, False)])  # seq 1: one chunk longer than the whole ring
    h.step([(0, 29, False), (1, 1, True)])
    h.step([(0, 7, False), (1, 1, True)])  # seq 0: chunk starting mid-page, past the ring
    h.decode([0, 1], 45)


def test_hierarchical_paging_changes_selection():
    """g = 4 (logical page 2) vs g = 1 (logical page 8) on identical data: different pages are
    selected, and each backend matches its own reference."""
    runs = []
    for lpage in (2, 8):
        h = Harness(heads=(4, 1), n_dense=(1,), lpage=lpage, budget=24, reuse=1, seed=5, mode="kv")
        h.add(0)
        h.prefill(0, [45])
        h.decode([0], 20)
        runs.append(h)
    sel_g4, sel_g1 = selections(runs[0].ref, 0, 0), selections(runs[1].ref, 0, 0)
    assert len(sel_g4) == len(sel_g1) == 20
    assert sum(a != b for a, b in zip(sel_g4, sel_g1)) >= 3
    diffs = [rel_err(a[0], b[0].double()) for a, b in zip(runs[0].outputs, runs[1].outputs)]
    assert max(diffs) > 1e-2


def test_query_vs_kv_mode_differ():
    """With G = 4, per-query-head selection picks different pages than per-KV-head selection."""
    runs = []
    for mode in ("query", "kv"):
        h = Harness(heads=(8, 2), n_dense=(2,), budget=16, reuse=1, seed=9, mode=mode)
        h.add(0)
        h.prefill(0, [41])
        h.decode([0], 12)
        runs.append(h)
    q_sel = selections(runs[0].ref, 0, 0)
    # query mode: heads of a group disagree somewhere; kv mode: a group always agrees.
    assert any(len({s[h] for h in range(4)}) > 1 for s in q_sel)
    for s in selections(runs[1].ref, 0, 0):
        assert len({s[h] for h in range(4)}) == 1 and len({s[h] for h in range(4, 8)}) == 1


@pytest.mark.parametrize("mode", ["kv", "query"])
def test_reuse_interval(mode):
    """C = 3: reused steps read the stored table (plus pages since), not a fresh selection."""
    h = Harness(heads=(8, 2), n_dense=(1, 2), budget=16, reuse=3, seed=21, mode=mode, extra_reuse=(1,))
    h.add(0)
    h.add(1)
    h.step([(0, 37, False), (1, 21, False)])
    h.decode([0, 1], 20)
    sched = [info[0]["select"] for info in h.ref.log if info[0]["decode"]]
    assert sched == [i % 3 == 0 for i in range(20)]
    # At some reused step, the stored table differs from what a fresh selection (C = 1) would read.
    fresh = selections(h.refs[1], 0, 1)
    reused = selections(h.ref, 0, 1)
    assert any(a != b for a, b in zip(reused, fresh))
    # ... and the backend's output follows the stored table (far from the C = 1 reference there).
    assert max(h.other_diffs[0]) > 1e-2
    # Reused tables grow: a page appended since the selection is read too.
    n_read = [len(s[0]) for s in reused]
    assert max(n_read) > 16 // 8


def test_reuse_interval_one_matches():
    """C = 1: the selector runs on every dynamic decode step."""
    h = Harness(heads=(6, 2), n_dense=(2, 1), budget=24, reuse=1, seed=4, lpage=2)
    h.add(0)
    h.prefill(0, [31, 6])
    h.decode([0], 20)
    assert all(info[0]["select"] for info in h.ref.log if info[0]["decode"] and info[0]["dynamic"])


@pytest.mark.parametrize("dense_layers", [1, 2])
def test_dense_layers(dense_layers):
    """Layers below ``dense_layers`` read every page even while selection is active elsewhere."""
    h = Harness(heads=(4, 2), n_dense=(2, 1, 1), budget=16, reuse=2, dense_layers=dense_layers, seed=13)
    h.add(0)
    h.prefill(0, [43])
    h.decode([0], 12)
    for layer in range(3):
        assert bool(selections(h.ref, 0, layer)) == (layer >= dense_layers)


def test_dynamic_threshold():
    """Selection starts exactly when the context reaches ``dynamic_threshold``."""
    h = Harness(heads=(4, 2), n_dense=(2, 1), budget=16, reuse=3, threshold=50, seed=17)
    h.add(0)
    h.prefill(0, [39])
    h.decode([0], 20)  # lengths 40 .. 59
    dyn = [info[0]["length"] for info in h.ref.log if info[0]["decode"] and info[0]["dynamic"]]
    assert dyn == list(range(50, 60))
    # the first dynamic step selects even though earlier decode steps happened
    first = next(info[0] for info in h.ref.log if info[0]["decode"] and info[0]["dynamic"])
    assert first["select"]


def test_budget_boundary_pages():
    """Dynamic turns on only once the pages exceed K = budget // page_size."""
    h = Harness(heads=(4, 2), n_dense=(2,), budget=32, reuse=1, seed=23)  # K = 4 pages = 32 tokens
    h.add(0)
    h.prefill(0, [29])
    h.decode([0], 8)  # lengths 30 .. 37
    dyn = [info[0]["length"] for info in h.ref.log if info[0]["decode"] and info[0]["dynamic"]]
    assert dyn == list(range(33, 38))


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["G1", "G4"])
def test_full_budget_equals_dense_exactly(heads):
    """No streaming heads and a budget covering the whole context: bit-identical to dense."""
    hs = [Harness(heads=heads, n_dense=(heads[1], heads[1]), budget=b, seed=31, reuse=2)
          for b in (512, 0)]
    for h in hs:
        h.add(0)
        h.add(1)
        h.step([(0, 23, False), (1, 7, False)])
        h.step([(0, 1, True), (1, 18, False)])
        h.decode([0, 1], 15)
    for a, b in zip(hs[0].outputs, hs[1].outputs):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert not any(i["dynamic"] for info in hs[0].ref.log for i in info.values())


@pytest.mark.parametrize("local", [16, 64])
def test_streaming_prefill_longer_than_a_query_block(local):
    """Streaming heads prefill block by block (256 queries at a time, over only the keys a block
    can see): one-shot and chunked prefills of several blocks, then decode."""
    h = Harness(heads=(4, 2), n_dense=(1, 1), sink=8, local=local, budget=0, seed=5 + local, num_pages=256)
    h.add(0)
    h.add(1)
    h.step([(0, 700, False), (1, 300, False)])
    h.step([(1, 333, False), (0, 1, True)])  # a chunk with cached past that spans two blocks
    h.decode([0, 1], 5)
