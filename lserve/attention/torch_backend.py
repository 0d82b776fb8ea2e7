"""Reference backend in plain torch (CPU or CUDA): exact semantics, no speed tricks.

* Dense heads attend causally to every cached token, or at decode with dynamic selection
  only to the pages in their index table (selected every C steps, reused in between; pages
  appended since the last selection are always read).
* Streaming heads attend to token t from query position p iff t < sink or p - t < local.
* Softmax in float32.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from lserve.attention.base import AttentionBackend
from lserve.attention.block_sparse_prefill import sparse_prefill
from lserve.sparsity.plan import SeqPlan, StepPlan
from lserve.sparsity.selector import page_scores, top_pages


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q: [H, G, Q, D]; k, v: [H, L, D]; mask: bool broadcastable to [H, G, Q, L] -> [H, G, Q, D]."""
    h, g, nq, d = q.shape
    qf = q.reshape(h, g * nq, d).float()
    s = torch.bmm(qf, k.float().transpose(1, 2)).mul_(scale)  # [H, G*Q, L]: one batched GEMM
    if mask is not None:
        s = s.view(h, g, nq, -1).masked_fill_(~mask, float("-inf")).view(h, g * nq, -1)
    p = torch.softmax(s, dim=-1)
    return torch.bmm(p, v.float()).view(h, g, nq, d).to(q.dtype)


def _attend_pages(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, scale: float) -> torch.Tensor:
    """One query token against whole pages in pool layout, without a head-major copy.

    q: [H, G, D]; k, v: [n, H, N, D] (the first ``length`` of the n*N tokens are valid)
    -> [H, G, D]. A decode step is memory-bound: K and V are read once, in place. With few
    KV heads, every query head is scored against every head's keys in one plain GEMM (H times
    the FLOPs of the useful blocks, which CPUs stream faster than many tiny batched GEMMs);
    the useful diagonal blocks are then picked out.
    """
    n, h, N, d = k.shape
    g = q.shape[1]
    qf = q.float()
    kf, vf = k.float(), v.float()
    if h <= 4:
        s_all = torch.mm(qf.reshape(h * g, d), kf.reshape(n * h * N, d).t())  # [H*G, n*H*N]
        s = s_all.view(h, g, n, h, N).diagonal(dim1=0, dim2=3)  # [G, n, N, H]
        s = s.permute(3, 0, 1, 2).reshape(h, g, n * N)
    else:
        s = torch.matmul(kf, qf.transpose(1, 2)).permute(1, 3, 0, 2).reshape(h, g, n * N)  # [H, G, n*N]
    p = torch.softmax(s[:, :, :length].mul_(scale), dim=-1)
    if length < n * N:
        p = F.pad(p, (0, n * N - length))
    if h <= 4:
        p_all = p.new_zeros(h, g, n, h, N)
        p_all.diagonal(dim1=0, dim2=3).copy_(p.view(h, g, n, N).permute(1, 2, 3, 0))
        return torch.mm(p_all.view(h * g, n * h * N), vf.reshape(n * h * N, d)).view(h, g, d).to(q.dtype)
    p = p.view(h, g, n, N).permute(2, 0, 1, 3)  # [n, H, G, N]
    return torch.matmul(p, vf).sum(0).to(q.dtype)  # [H, G, D]


class TorchBackend(AttentionBackend):
    """The oracle backend. Holds the reused page selections per (layer, sequence)."""

    name = "torch"
    supports_adaptive_budgets = True
    supports_prefill_sparsity = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # layer -> seq_id -> (page indices [H_sel, K-1] excluding the last, pages at selection)
        self.selection: list[dict[int, tuple[torch.Tensor, int]]] = [{} for _ in range(self.model.num_layers)]

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        for sel in self.selection:
            sel.pop(seq_id, None)

    # -- writes -------------------------------------------------------------------------------
    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, dense_w, stream_w) -> None:
        nd = self.cache.n_dense[layer]
        tok, pages, offs = dense_w
        if tok.numel():
            kd = k[tok, :nd]
            self.cache.dense[layer].write(pages, offs, kd, v[tok, :nd])
            self.cache.stats[layer].update(pages, offs, kd)
        tok, pages, offs = stream_w
        if tok.numel():
            self.cache.stream[layer].write(pages, offs, k[tok, nd:], v[tok, nd:])

    def run(self, layer, q, k, v, plan: StepPlan):
        self._write(layer, k, v, plan.dense_write_decode, plan.stream_write_decode)
        out = torch.empty_like(q)
        for sp in plan.seqs:
            sl = slice(sp.t0, sp.t1)
            if sp.step.decode:
                out[sp.t0] = self._decode(layer, sp, q[sp.t0])
            else:
                out[sl] = self._prefill(layer, sp, q[sl], k[sl], v[sl])
        self._write(layer, k, v, plan.dense_write_prefill, plan.stream_write_prefill)
        return out

    # -- helpers ------------------------------------------------------------------------------
    def _dense_kv(self, layer: int, pages: torch.Tensor, length: int, page_list: list[int] | None = None):
        """Cached K/V of the dense heads for the first ``length`` tokens: two [H_d, L, D]
        (``page_list``: the page ids on the host, for the host KV tier's bulk reads)."""
        return self.cache.dense[layer].sequence_kv(pages, length, page_list)

    def _ring_kv(self, layer: int, sp: SeqPlan):
        """Cached K/V of the streaming heads and their positions: [H_s, R*N, D] x2, [R*N]."""
        N = self.cache.page_size
        hs = self.cache.n_stream[layer]
        heads = torch.arange(hs, device=sp.ring_pages.device)[:, None]
        k, v = self.cache.stream[layer].gather(sp.ring_pages.expand(hs, -1), heads)  # [Hs, R, N, D]
        pos = (sp.ring_first_pos[:, None] + torch.arange(N, device=k.device)).reshape(-1)
        d = k.shape[-1]
        return k.view(hs, -1, d), v.view(hs, -1, d), pos

    def _lambda_mask(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """Streaming (Λ) mask [Q, L]: causal and (sink or local)."""
        rel = qpos[:, None] - kpos[None, :]
        return (rel >= 0) & ((kpos[None, :] < self.sp.sink_tokens) | (rel < self.sp.local_tokens))

    # -- decode -------------------------------------------------------------------------------
    def _decode(self, layer: int, sp: SeqPlan, q: torch.Tensor) -> torch.Tensor:
        """q: [H_q, D] (one token) -> [H_q, D]."""
        G, nd = self.group, self.cache.n_dense[layer]
        hq, d = q.shape
        N = self.cache.page_size
        out = torch.empty_like(q)
        if nd:
            kp = self.layer_budget(layer, sp)  # pages of this layer's selection, 0: every page
            if kp:
                table = self._page_table(layer, sp, q[: nd * G], kp)  # [H_sel, C] indices into sp.pages
                rows = table.shape[0]
                heads = torch.arange(rows, device=q.device)[:, None] // (rows // nd)
                pages = sp.pages[table]
                if self.cache.host_tier is not None:  # selected pages go resident before attention
                    self.cache.host_tier.fetch(layer, pages)
                k, v = self.cache.dense[layer].gather(pages, heads)  # [H_sel, C, N, D]
                pos = (table[:, :, None] * N + torch.arange(N, device=q.device)).view(rows, 1, 1, -1)
                qd = q[: nd * G].view(rows, -1, 1, d)  # kv mode: [Hd, G, 1, D]; query mode: [Hd*G, 1, 1, D]
                o = _attend(qd, k.view(rows, -1, d), v.view(rows, -1, d), pos < sp.length, self.scale)
            else:
                k, v = self.cache.dense[layer].pages_view(sp.pages, sp.step.dense_pages)
                o = _attend_pages(q[: nd * G].view(nd, G, d), k, v, sp.length, self.scale)
            out[: nd * G] = o.reshape(nd * G, d)
        if nd < self.model.num_kv_heads:
            hs = self.model.num_kv_heads - nd
            k, v, pos = self._ring_kv(layer, sp)
            keep = (pos < sp.length) & self._lambda_mask(torch.tensor([sp.length - 1], device=pos.device), pos)[0]
            qs = q[nd * G:].view(hs, G, 1, d)
            out[nd * G:] = _attend(qs, k[:, keep], v[:, keep], None, self.scale).view(hs * G, d)
        return out

    def _page_table(self, layer: int, sp: SeqPlan, qd: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """Pages each selecting head reads, as indices into ``sp.pages``: long [H_sel, C]; ``k``:
        pages a selector run keeps (the layer's budget; None: the sequence's).

        Runs the selector or reuses its last choice; pages that appeared since that choice
        (from the then-last page on) are always read.
        """
        n = sp.pages.numel()
        state = self.selection[layer].get(sp.step.seq_id)
        if sp.select or state is None:
            t0 = time.perf_counter()
            stats = self.cache.stats[layer]
            scores = page_scores(qd, stats.kmax[sp.pages], stats.kmin[sp.pages], self.group, self.sp.select_mode)
            idx = top_pages(scores, sp.budget_pages if k is None else k)
            state = (idx[:, :-1], n)
            self.selection[layer][sp.step.seq_id] = state
            st = self.selector_stats
            st.runs += 1
            st.pages += idx.numel()
            st.seconds += time.perf_counter() - t0
        else:
            self.selector_stats.reuses += 1
        chosen, n_at_select = state
        recent = torch.arange(n_at_select - 1, n, device=qd.device).expand(chosen.shape[0], -1)
        return torch.cat((chosen, recent), dim=1)

    # -- prefill ------------------------------------------------------------------------------
    def _prefill(self, layer: int, sp: SeqPlan, q, k, v) -> torch.Tensor:
        """q: [n, H_q, D]; k, v: [n, H_kv, D] fresh chunk -> [n, H_q, D]."""
        G, nd = self.group, self.cache.n_dense[layer]
        n, hq, d = q.shape
        start = sp.step.start
        dev = q.device
        qpos = torch.arange(start, start + n, device=dev)
        out = torch.empty_like(q)
        if nd:
            kc, vc = k[:, :nd].transpose(0, 1), v[:, :nd].transpose(0, 1)  # [Hd, n, D]
            if start:
                kp, vp = self._dense_kv(layer, sp.pages[: -(-start // self.cache.page_size)], start, sp.step.dense_pages)
                kc, vc = torch.cat((kp, kc), 1), torch.cat((vp, vc), 1)
            qd = q[:, : nd * G].transpose(0, 1)  # [Hd*G, n, D]
            blocks = self.sparse_prefill_blocks(sp, layer, qd, kc)
            if blocks is not None:
                out[:, : nd * G] = sparse_prefill(qd, kc, vc, blocks, self.scale).transpose(0, 1)
            else:
                mask = None if start == 0 else (torch.arange(start + n, device=dev)[None, :] <= qpos[:, None])
                o = F.scaled_dot_product_attention(
                    qd.unsqueeze(0), kc.unsqueeze(0), vc.unsqueeze(0), attn_mask=mask,
                    is_causal=start == 0, scale=self.scale, enable_gqa=True)
                out[:, : nd * G] = o[0].transpose(0, 1)
        if nd < self.model.num_kv_heads:
            kc, vc = k[:, nd:].transpose(0, 1), v[:, nd:].transpose(0, 1)
            kpos = qpos
            if start and sp.ring_pages.numel():
                kr, vr, rpos = self._ring_kv(layer, sp)
                old = rpos < start
                kc, vc = torch.cat((kr[:, old], kc), 1), torch.cat((vr[:, old], vc), 1)
                kpos = torch.cat((rpos[old], qpos))
            qs = q[:, nd * G:].transpose(0, 1)  # [Hs*G, n, D]
            out[:, nd * G:] = self._streaming_prefill(qs, kc, vc, qpos, kpos).transpose(0, 1)
        return out

    def _streaming_prefill(self, qs, kc, vc, qpos, kpos) -> torch.Tensor:
        """Λ-masked attention of streaming heads, one block of queries at a time over only the
        keys the block can see (sink + its local window): O(n (sink + local)), not O(n^2).

        qs: [Hs*G, n, D]; kc, vc: [Hs, L, D]; qpos [n], kpos [L] ascending -> [Hs*G, n, D].
        """
        n = qs.shape[1]
        block = max(self.sp.local_tokens, 256)
        out = torch.empty_like(qs)
        for a in range(0, n, block):
            b = min(n, a + block)
            lo, hi = int(qpos[a]) - self.sp.local_tokens, int(qpos[b - 1])
            keep = (kpos < self.sp.sink_tokens) | ((kpos > lo) & (kpos <= hi))
            kp = kpos[keep]
            o = F.scaled_dot_product_attention(
                qs[:, a:b].unsqueeze(0), kc[:, keep].unsqueeze(0), vc[:, keep].unsqueeze(0),
                attn_mask=self._lambda_mask(qpos[a:b], kp), scale=self.scale, enable_gqa=True)
            out[:, a:b] = o[0]
        return out
