"""Dense heads' prefill restricted to a block list (:class:`lserve.sparsity.prefill_blocks.PrefillBlocks`).

Semantics: causal attention over the kept tiles only. Two implementations of it:

* :func:`sparse_prefill` (what the backends run): one query row at a time, the row's kept KV
  blocks before its own span gather into a dense past (every KV head keeps the same number of
  blocks, see :func:`lserve.sparsity.prefill_blocks.select_blocks`), then the row attends to that
  past and causally to itself through :func:`lserve.attention.chunked.dense_chunk`: fused dense
  attention kernels (flash or cuDNN on a GPU) run only on kept tiles.
* :func:`blocked_prefill` (the reference tests compare against): the same rows with a token mask,
  float32 softmax.
"""

from __future__ import annotations

import torch

from lserve.attention.chunked import attention_lse, dense_chunk, long_impl
from lserve.sparsity.prefill_blocks import PrefillBlocks


def _gather_blocks(x: torch.Tensor, idx: torch.Tensor, B: int) -> torch.Tensor:
    """x: [H, L, D]; idx: long [H, m] block ids (each block whole inside L) -> [H, m * B, D]."""
    h = x.shape[0]
    tok = (idx[:, :, None] * B + torch.arange(B, device=x.device)).reshape(h, -1)  # [H, m*B]
    return x[torch.arange(h, device=x.device)[:, None], tok]


def sparse_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: PrefillBlocks,
                   scale: float, impl: str | None = None) -> torch.Tensor:
    """Block-sparse causal attention of a chunk, computing only kept tiles.

    Parameters
    ----------
    q : torch.Tensor
        [H_kv * G, Lq, D] queries of positions ``blocks.start ..`` (query head h uses KV head h // G).
    k, v : torch.Tensor
        [H_kv, L, D] keys/values of positions 0 .. L - 1 (``L == blocks.length``; views are fine).
    blocks : PrefillBlocks
        Every KV head keeps the same number of tiles per row.
    scale : float
    impl : str, optional
        Fused kernel to force on CUDA (``"flash"`` / ``"cudnn"``, benchmarks); default:
        :func:`lserve.attention.chunked.long_impl` (cuDNN on long sequences: on the H200 it ran
        kept tiles 1.5-1.6x faster than flash at 128k-256k, ``benchmarks/prefill_sparsity/sparse_prefill_h200.json``).

    Returns
    -------
    torch.Tensor
        [H_kv * G, Lq, D] in q's dtype.
    """
    hq, lq, d = q.shape
    h = k.shape[0]
    g, B, start = hq // h, blocks.block, blocks.start
    out = torch.empty_like(q)
    impl = impl or long_impl(q.device, q.dtype, d, blocks.length)
    indptr = blocks.indptr.cpu()
    counts = indptr[:, 1:] - indptr[:, :-1]  # [H, R]
    if not bool((counts == counts[:1]).all()):
        raise ValueError("sparse_prefill needs the same number of kept tiles per KV head in each row")
    for r in range(blocks.n_rows):
        rs, re = blocks.row_span(r)
        a = max(start, rs)  # the row's first query of this chunk
        m = int(counts[0, r])
        # the row's own blocks (rs // B .. its last) are all kept and close each ascending list
        n_past = m - ((re - 1) // B - rs // B + 1)
        pos = (indptr[:, r, None] + torch.arange(n_past)).reshape(-1).to(blocks.indices.device)
        idx = blocks.indices[pos].long().view(h, n_past)  # [H, n_past] blocks before the row's span
        kp = [_gather_blocks(k, idx, B)] if n_past else []
        vp = [_gather_blocks(v, idx, B)] if n_past else []
        if a > rs:  # the row's span before this chunk: seen by every query of the chunk's part
            kp.append(k[:, rs:a])
            vp.append(v[:, rs:a])
        qr = q[:, a - start: re - start]
        kn, vn = k[:, a:re], v[:, a:re]
        if kp:
            o = dense_chunk(qr, torch.cat(kp, 1) if len(kp) > 1 else kp[0],
                            torch.cat(vp, 1) if len(vp) > 1 else vp[0], kn, vn, g, scale, impl)
        else:
            o, _ = attention_lse(qr, kn.repeat_interleave(g, 0), vn.repeat_interleave(g, 0), True, scale, impl)
        out[:, a - start: re - start] = o
    return out


def blocked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: PrefillBlocks, scale: float) -> torch.Tensor:
    """Block-sparse causal attention of a chunk: the masked reference of :func:`sparse_prefill`.

    Parameters
    ----------
    q : torch.Tensor
        [H_kv * G, Lq, D] queries of positions ``blocks.start ..`` (query head h uses KV head h // G).
    k, v : torch.Tensor
        [H_kv, L, D] keys/values of positions 0 .. L - 1 (``L == blocks.length``).
    blocks : PrefillBlocks
    scale : float

    Returns
    -------
    torch.Tensor
        [H_kv * G, Lq, D] in q's dtype.
    """
    hq, lq, d = q.shape
    h, L, _ = k.shape
    g, B, start = hq // h, blocks.block, blocks.start
    nkb = -(-L // B)
    pad = nkb * B - L
    kb = torch.nn.functional.pad(k.float(), (0, 0, 0, pad)).view(h, nkb, B, d)
    vb = torch.nn.functional.pad(v.float(), (0, 0, 0, pad)).view(h, nkb, B, d)
    indptr = blocks.indptr.long().cpu()
    idx = blocks.indices.long()
    out = torch.empty_like(q)
    heads = torch.arange(h, device=q.device)[:, None]
    for r in range(blocks.n_rows):
        rs, b = blocks.row_span(r)
        a = max(start, rs)  # positions of this row's queries
        lo, hi = indptr[:, r], indptr[:, r + 1]
        m = int((hi - lo).max())
        sel = torch.zeros(h, m, dtype=torch.long, device=q.device)
        ok = torch.zeros(h, m, dtype=torch.bool, device=q.device)
        for i in range(h):
            n = int(hi[i] - lo[i])
            sel[i, :n] = idx[int(lo[i]): int(hi[i])]
            ok[i, :n] = True
        kk, vv = kb[heads, sel].reshape(h, m * B, d), vb[heads, sel].reshape(h, m * B, d)  # [H, m*B, D]
        kpos = (sel[:, :, None] * B + torch.arange(B, device=q.device)).reshape(h, m * B)
        qpos = torch.arange(a, b, device=q.device)
        vis = ok.repeat_interleave(B, 1)[:, None, :] & (kpos[:, None, :] <= qpos[None, :, None])  # [H, n, m*B]
        qq = q[:, a - start: b - start].float().reshape(h, g * (b - a), d)
        s = torch.bmm(qq, kk.transpose(1, 2)).mul_(scale).view(h, g, b - a, m * B)
        s.masked_fill_(~vis[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1).view(h, g * (b - a), m * B)
        out[:, a - start: b - start] = torch.bmm(p, vv).view(hq, b - a, d).to(q.dtype)
    return out
