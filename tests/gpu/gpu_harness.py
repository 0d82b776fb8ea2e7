"""Drive the torch (oracle) and cupy backends through the same steps and compare them.

Two identical caches (pre-filled with random garbage, so reads of stale slots show up), the same
page ids for both, random q/k/v per layer and step; the cupy output is NaN-poisoned before each
launch and must come back finite everywhere.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field

import torch

from lserve.attention.cupy_backend import CupyBackend
from lserve.attention.torch_backend import TorchBackend
from lserve.cache.kv_cache import KVCache
from lserve.config import CacheConfig, ModelConfig, SparsityConfig
from lserve.sparsity.adaptive_budget import ADAPTIVE_KIND
from lserve.sparsity.plan import SeqStep
from lserve.sparsity.selector import page_scores

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@dataclass
class Seq:
    seq_id: int
    tokens: int  # total tokens the sequence will hold
    computed: int = 0
    dense_pages: list[int] = field(default_factory=list)
    stream_pages: list[int] = field(default_factory=list)
    budget: int | None = None  # per-request token budget override


def model_config(D: int, hkv: int, G: int, layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=D * hkv * G, intermediate_size=64, num_layers=layers,
                       num_heads=hkv * G, num_kv_heads=hkv, head_dim=D)


def randomize_cache(cache: KVCache, gen: torch.Generator) -> None:
    """Fill every pool and statistic with random finite values."""
    def fill(t):
        if t is None or t.numel() == 0:
            return
        if t.dtype in (torch.int8,):
            t.copy_(torch.randint(-127, 128, t.shape, generator=gen, device=t.device, dtype=torch.int16).to(t.dtype))
        elif t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, device=t.device, dtype=torch.int16).to(t.dtype))
        else:
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32).to(t.dtype))
    for pool in cache.dense + cache.stream:
        for t in (pool.k, pool.v, pool.k_zero, pool.v_zero):
            fill(t)
        for t in (pool.k_scale, pool.v_scale):
            if t is not None:
                t.copy_(torch.rand(t.shape, generator=gen, device=t.device) * 0.02 + 0.001)
    for st in cache.stats:
        if st.kmax.numel():
            a = torch.randn(st.kmax.shape, generator=gen, device=st.kmax.device)
            b = torch.randn(st.kmax.shape, generator=gen, device=st.kmax.device)
            st.kmax.copy_(torch.maximum(a, b).to(st.kmax.dtype))
            st.kmin.copy_(torch.minimum(a, b).to(st.kmin.dtype))


def copy_cache(dst: KVCache, src: KVCache) -> None:
    for pd, ps in zip(dst.dense + dst.stream, src.dense + src.stream):
        for name in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero"):
            a, b = getattr(pd, name), getattr(ps, name)
            if a is not None:
                a.copy_(b)
    for sd, ss in zip(dst.stats, src.stats):
        sd.kmax.copy_(ss.kmax)
        sd.kmin.copy_(ss.kmin)


class Pair:
    """A torch and a cupy backend over identical caches.

    Parameters
    ----------
    n_dense : list[int]
        Dense KV heads per layer (the rest stream).
    split : str
        ``"auto"``, ``"direct"`` (one unit per work item) or ``"many"`` (one table entry per unit).
    """

    def __init__(self, *, dtype=torch.bfloat16, D=128, hkv=2, G=4, n_dense=(1, 2), page_size=16, logical=4,
                 kv_quant="none", sink=32, local=64, budget=128, reuse=3, select_mode="kv", num_pages=2048,
                 max_seqs=8, dense_layers=0, select_layers="all", split="auto", seed=0, device="cuda",
                 backend_cls=CupyBackend, ratios=None) -> None:
        self.dtype, self.D, self.hkv, self.G = dtype, D, hkv, G
        self.mc = model_config(D, hkv, G, len(n_dense))
        adaptive = ""
        if ratios is not None:  # per-layer budgets around the mean (a calibration file, as shipped)
            fd, adaptive = tempfile.mkstemp(suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump({"kind": ADAPTIVE_KIND, "ratios": list(ratios)}, f)
        self.sp = SparsityConfig(pattern="random" if any(n < hkv for n in n_dense) else None, sink_tokens=sink,
                                 local_tokens=local, token_budget=budget, reuse_interval=reuse,
                                 select_mode=select_mode, dense_layers=dense_layers, select_layers=select_layers,
                                 adaptive_budgets=adaptive)
        self.cc = CacheConfig(page_size=page_size, logical_page_size=logical, num_pages=num_pages, kv_quant=kv_quant)
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        args = (self.mc, self.cc, list(n_dense), sink, local, max_seqs, dtype, device)
        self.cache_t, self.cache_c = KVCache(*args), KVCache(*args)
        randomize_cache(self.cache_t, self.gen)
        copy_cache(self.cache_c, self.cache_t)
        self.ref = TorchBackend(self.mc, self.sp, self.cache_t)
        self.cup = backend_cls(self.mc, self.sp, self.cache_c)
        if split == "direct":
            self.cup.tune(target_ctas=1, min_chunk=256)
        elif split == "many":
            self.cup.tune(target_ctas=1 << 30, min_chunk=1)
        self.alloc = self.cache_t.dense_alloc  # page ids shared by both caches
        self.salloc = self.cache_t.stream_alloc
        self.errors: list[float] = []
        self.selections_checked = 0

    # -- sequences ----------------------------------------------------------------------------
    def grow(self, s: Seq, length: int) -> None:
        need = -(-length // self.cc.page_size) - len(s.dense_pages)
        if need > 0:
            s.dense_pages += self.alloc.allocate(need)
        if self.cache_t.has_streaming and not s.stream_pages:
            s.stream_pages = self.salloc.allocate(self.cache_t.stream_pages_per_seq)

    def release(self, s: Seq) -> None:
        self.alloc.free(s.dense_pages)
        if s.stream_pages:
            self.salloc.free(s.stream_pages)
        s.dense_pages, s.stream_pages = [], []
        self.ref.release(s.seq_id)
        self.cup.release(s.seq_id)

    # -- one step -----------------------------------------------------------------------------
    def step(self, work: list[tuple[Seq, int, bool]], q_gain: float = 2.0) -> None:
        """Run one step: (sequence, tokens now, decode?) for each participant; compare every layer."""
        steps = []
        for s, n, dec in work:
            self.grow(s, s.computed + n)
            steps.append(SeqStep(s.seq_id, s.computed, n, dec, list(s.dense_pages), list(s.stream_pages), s.budget))
        plan_t, plan_c = self.ref.plan(steps), self.cup.plan(steps)
        T = sum(n for _, n, _ in work)
        hq, D = self.mc.num_heads, self.D
        tol = TOL[self.dtype]
        for layer in range(self.mc.num_layers):
            q = (torch.randn(T, hq, D, device=self.device, generator=self.gen) * q_gain).to(self.dtype)
            kv = torch.randn(T, 2, self.hkv, D, device=self.device, generator=self.gen).to(self.dtype)
            k, v = kv[:, 0], kv[:, 1]  # token stride 2*H*D: exercises strided rows
            ref = self.ref.run(layer, q, k.contiguous(), v.contiguous(), plan_t)
            out = torch.full_like(q, float("nan"))
            self.cup.attend(layer, q, k, v, plan_c, out)
            assert torch.isfinite(out).all(), f"layer {layer}: unwritten or non-finite output rows"
            for sp in plan_t.seqs:
                a, b = out[sp.t0: sp.t1].float(), ref[sp.t0: sp.t1].float()
                err = rel_err(a, b)
                self.errors.append(err)
                kind = "decode" if sp.step.decode else f"prefill(start={sp.step.start})"
                assert err < tol, f"layer {layer} seq {sp.step.seq_id} {kind}: rel err {err:.3g} >= {tol}"
                # per head too: one wrong head must not hide in the average
                per_head = ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)).max().item()
                assert per_head < 5 * tol, f"layer {layer} seq {sp.step.seq_id} {kind}: head rel err {per_head:.3g}"
                # the layer reads a selection (adaptive budgets: its own K), made this step
                if sp.step.decode and sp.select and self.ref.layer_budget(layer, sp):
                    self.check_selection(layer, sp, q[sp.t0])
        for s, n, _ in work:
            s.computed += n

    def check_selection(self, layer: int, sp, q_row: torch.Tensor) -> None:
        """The cupy selection state equals the torch one (ties within float rounding allowed)."""
        sid = sp.step.seq_id
        chosen, n_at = self.ref.selection[layer][sid]  # [H_sel, K-1] ascending
        nd = self.cache_t.n_dense[layer]
        slot = self.cup.table_planner.slots[sid]
        assert self.cup.table_planner.nsel[sid] == n_at
        cnt = self.cup._sel_cnt[layer, slot, :nd].cpu()
        idx = self.cup._sel_idx[layer, slot, :nd].cpu()
        page = self.cup._sel_page[layer, slot, :nd].cpu()
        seq_pages = sp.pages.cpu()
        chosen = chosen.cpu()
        G, k1 = self.G, chosen.shape[1]
        stats = self.cache_t.stats[layer]
        mode = self.sp.select_mode
        scores = page_scores(q_row[: nd * G], stats.kmax[sp.pages], stats.kmin[sp.pages], G, mode).cpu()
        for h in range(nd):
            c = int(cnt[h])
            got = idx[h, :c]
            assert torch.all(got[1:] > got[:-1]), "selection must be strictly ascending"
            assert torch.equal(page[h, :c].long(), seq_pages[got.long()]), "sel_page must hold the selected pages"
            if mode == "kv":
                assert c == k1, f"kv mode keeps K-1 = {k1} pages, got {c}"
                self._same_or_tie(got, chosen[h], scores[h], k1)
                continue
            masks = self.cup._sel_mask[layer, slot, h, :c].cpu()
            exact = True
            for g in range(G):
                mine = got[(masks >> g) & 1 == 1]
                exact &= self._same_or_tie(mine, chosen[h * G + g], scores[h * G + g], k1)
            if exact:  # without ties the union and its head masks are determined
                assert torch.equal(got, torch.unique(chosen[h * G:(h + 1) * G]).to(got.dtype))
        self.selections_checked += 1

    @staticmethod
    def _same_or_tie(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, k1: int) -> bool:
        """True if ``got`` equals ``want``; else asserts the difference is a score tie and returns False."""
        assert len(got) == k1, f"expected {k1} pages, got {len(got)}"
        if torch.equal(got, want.to(got.dtype)):
            return True
        cand = scores[:-1]
        kth = torch.topk(cand, k1).values[-1]
        worst_kept = cand[got.long()].min()
        tol = 1e-5 * cand.abs().max().item()
        assert worst_kept >= kth - tol, (f"selection differs beyond a tie: got {got.tolist()} want "
                                         f"{want.tolist()} (worst kept {worst_kept:.6g} < k-th {kth:.6g})")
        return False

    def compare_caches(self) -> None:
        """Pools and statistics of both caches agree (quantized codes may differ by one, rarely)."""
        for li in range(self.mc.num_layers):
            for kind, pt, pc in (("dense", self.cache_t.dense[li], self.cache_c.dense[li]),
                                 ("stream", self.cache_t.stream[li], self.cache_c.stream[li])):
                for name in ("k", "v"):
                    a, b = getattr(pc, name), getattr(pt, name)
                    if a.numel() == 0:
                        continue
                    if pt.kv_quant == "none":
                        assert torch.equal(a, b), f"layer {li} {kind} {name} differs"
                    else:
                        ai, bi = a.to(torch.int16), b.to(torch.int16)
                        if pt.kv_quant == "int4":
                            ai = torch.stack((ai & 15, ai >> 4), -1)
                            bi = torch.stack((bi & 15, bi >> 4), -1)
                        diff = (ai - bi).abs()
                        assert diff.max() <= 1, f"layer {li} {kind} {name}: codes differ by {diff.max()}"
                        assert (diff > 0).float().mean() < 1e-4, f"layer {li} {kind} {name}: many codes differ"
                for name in ("k_scale", "v_scale", "k_zero", "v_zero"):
                    a, b = getattr(pc, name), getattr(pt, name)
                    if a is not None and a.numel():
                        torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=f"layer {li} {kind} {name}")
            st, sc = self.cache_t.stats[li], self.cache_c.stats[li]
            assert torch.equal(st.kmax, sc.kmax), f"layer {li} kmax differs"
            assert torch.equal(st.kmin, sc.kmin), f"layer {li} kmin differs"
