"""Hierarchical page selection for dense heads at decode (SPEC.md section 4), torch reference.

Score of logical page j for query q:  S_j = sum_i max(q_i * kmax_ji, q_i * kmin_ji).
Since kmax >= kmin, max(q*kmax, q*kmin) = relu(q)*kmax + min(q, 0)*kmin, so the score is two
matrix-vector products. Physical page score = max over its g logical pages; top-k physical
pages under the token budget, the last (partially filled) page always kept.
"""

from __future__ import annotations

import torch


def page_scores(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, group_size: int,
                mode: str) -> torch.Tensor:
    """Physical-page upper-bound scores.

    Parameters
    ----------
    q : [H_dense * G, D] query of one sequence's dense heads.
    kmax, kmin : [n, g, H_dense, D] statistics of the sequence's pages, in table order.
    mode : ``"kv"`` (max over the G query heads of a group) or ``"query"``.

    Returns
    -------
    torch.Tensor
        float32 [H_sel, n] with H_sel = H_dense (kv) or H_dense * G (query).
    """
    n, g, hd, d = kmax.shape
    qf = q.float().view(hd, group_size, d)
    pos, neg = qf.clamp(min=0), qf.clamp(max=0)
    mx = kmax.float().permute(2, 0, 1, 3).reshape(hd, n * g, d)  # [Hd, n*g, D]
    mn = kmin.float().permute(2, 0, 1, 3).reshape(hd, n * g, d)
    s = pos @ mx.transpose(1, 2) + neg @ mn.transpose(1, 2)  # [Hd, G, n*g]
    s = s.view(hd, group_size, n, g).amax(dim=-1)  # [Hd, G, n]: hierarchical max-reduce
    return s.amax(dim=1) if mode == "kv" else s.reshape(hd * group_size, n)


def top_pages(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the kept pages, ascending, last page always in.

    scores: [H_sel, n] with n > k -> long [H_sel, k].
    """
    n = scores.shape[1]
    best = torch.topk(scores[:, : n - 1], k - 1, dim=1).indices
    last = torch.full((scores.shape[0], 1), n - 1, dtype=best.dtype, device=best.device)
    return torch.cat((best.sort(dim=1).values, last), dim=1)
