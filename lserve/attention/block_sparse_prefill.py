"""Dense heads' prefill restricted to a block list (:class:`lserve.sparsity.prefill_blocks.PrefillBlocks`).

Reference semantics: causal attention over the kept tiles only, float32 softmax. One query block
at a time: each head gathers its kept key blocks (padded to the row's longest list, padding masked).
"""

from __future__ import annotations

import torch

from lserve.sparsity.prefill_blocks import PrefillBlocks


def blocked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: PrefillBlocks, scale: float) -> torch.Tensor:
    """Block-sparse causal attention of a chunk.

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
        qb = blocks.first_row_block + r
        a, b = max(start, qb * B), min(L, (qb + 1) * B)  # positions of this row's queries
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
