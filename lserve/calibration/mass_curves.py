"""Attention mass kept by a page selection, as a curve over the number of pages kept.

For one decode query of one layer, the exact softmax probabilities say how much of the
attention mass each page holds. Ordering the pages by some score (the min/max upper bound the
engine's selector uses, or the true mass itself: the oracle) and summing the masses in that
order gives, in one pass, the mass kept for every page budget K: ``curve[:, K - 1]``. As in
:func:`~lserve.sparsity.selector.top_pages`, the last (partially filled) page always comes first.

Used by ``lserve bench selection-mass`` (the diagnosis: estimator, page granularity or budget)
and by the adaptive-budget calibration; pure tensor functions, no engine state.
"""

from __future__ import annotations

import torch


def key_stats_from_keys(k: torch.Tensor, page_size: int, logical_page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel-wise max/min of the keys of every logical page, laid out as the cache's
    :class:`~lserve.cache.key_stats.KeyStats` of a sequence's pages in table order.

    Parameters
    ----------
    k : torch.Tensor
        [H, L, D] keys of one sequence's dense heads (token order).
    page_size, logical_page_size : int
        N_P and N_L (N_L divides N_P).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``kmax, kmin``: [n, g, H, D] with n = ceil(L / N_P) and g = N_P / N_L. Logical pages
        past the last token (in the last physical page) hold zeros, as fresh cache slots do;
        the selector always keeps the last page, so their value never decides anything.
    """
    if page_size % logical_page_size:
        raise ValueError(f"logical page {logical_page_size} does not divide page {page_size}")
    h, length, d = k.shape
    g = page_size // logical_page_size
    n = -(-length // page_size)
    nl = n * g
    kf = k.float()
    pad = nl * logical_page_size - length
    hi = torch.nn.functional.pad(kf, (0, 0, 0, pad), value=float("-inf")).view(h, nl, logical_page_size, d)
    lo = torch.nn.functional.pad(kf, (0, 0, 0, pad), value=float("inf")).view(h, nl, logical_page_size, d)
    kmax, kmin = hi.amax(2), lo.amin(2)  # [H, nl, D]
    empty = torch.arange(nl, device=k.device) * logical_page_size >= length  # [nl]
    kmax[:, empty] = 0.0
    kmin[:, empty] = 0.0
    return (kmax.view(h, n, g, d).permute(1, 2, 0, 3).contiguous(),
            kmin.view(h, n, g, d).permute(1, 2, 0, 3).contiguous())


def page_mass(p: torch.Tensor, page_size: int) -> torch.Tensor:
    """Mass per page: p [..., L] probabilities -> [..., ceil(L / page_size)]."""
    length = p.shape[-1]
    n = -(-length // page_size)
    padded = torch.nn.functional.pad(p, (0, n * page_size - length))
    return padded.view(*p.shape[:-1], n, page_size).sum(-1)


def kept_mass_curve(mass: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Mass kept with 1, 2, ..., n pages when pages are taken by descending ``scores``.

    Parameters
    ----------
    mass : torch.Tensor
        [H, n] mass of each page (rows sum to 1).
    scores : torch.Tensor
        [H, n] selection scores (the upper bound, or ``mass`` itself for the oracle).

    Returns
    -------
    torch.Tensor
        float32 [H, n]: ``curve[:, K - 1]`` is the mass of the last page plus the K - 1
        best-scored others (the selector's rule).
    """
    s = scores.float().clone()
    s[:, -1] = float("inf")  # the last page is always kept
    order = torch.argsort(s, dim=1, descending=True, stable=True)
    return mass.float().gather(1, order).cumsum(1)


def mass_at_budgets(curve: torch.Tensor, budgets: list[int], page_size: int) -> torch.Tensor:
    """Mass kept at each token budget: curve [H, n] -> [len(budgets), H].

    ``budget // page_size`` pages (at least one) are kept; a budget of at least the context's
    pages reads everything (as the engine does when ``n_pages <= K``), mass 1.
    """
    h, n = curve.shape
    out = torch.ones(len(budgets), h, dtype=curve.dtype, device=curve.device)
    for i, b in enumerate(budgets):
        k = max(b // page_size, 1)
        if k < n:
            out[i] = curve[:, k - 1]
    return out


def token_oracle_at_budgets(p: torch.Tensor, budgets: list[int]) -> torch.Tensor:
    """Mass of the best ``B`` single tokens (no page granularity): p [H, L] -> [len(budgets), H]."""
    h, length = p.shape
    curve = p.float().sort(dim=1, descending=True).values.cumsum(1)  # [H, L]
    out = torch.ones(len(budgets), h, dtype=curve.dtype, device=p.device)
    for i, b in enumerate(budgets):
        if b < length:
            out[i] = curve[:, b - 1]
    return out
