"""Per-logical-page key statistics (channel-wise min and max) for the page selector.

Stored per layer as ``kmax, kmin``: [P, g, H_dense, D] where g = N_P / N_L logical pages per
physical page, so ``view(P * g, H, D)`` indexes logical slots directly (slot = page * g + j).
A slot is reset when the first token of its logical page is written, so statistics never
mix tokens of a page's previous owner.
"""

from __future__ import annotations

import warnings

import torch

# index_reduce_ is marked beta but is the one fused scatter-max/min torch has.
warnings.filterwarnings("ignore", message="index_reduce", category=UserWarning)


class KeyStats:
    """kmax/kmin of one layer's dense heads."""

    def __init__(self, num_pages: int, num_heads: int, page_size: int, logical_page_size: int,
                 head_dim: int, dtype: torch.dtype, device) -> None:
        self.logical_page_size = logical_page_size
        self.g = page_size // logical_page_size
        shape = (num_pages, self.g, num_heads, head_dim)
        self.kmax = torch.zeros(shape, dtype=dtype, device=device)
        self.kmin = torch.zeros(shape, dtype=dtype, device=device)

    def nbytes(self) -> int:
        return 2 * self.kmax.numel() * self.kmax.element_size()

    def update(self, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor) -> None:
        """Fold new keys into the statistics. pages, offsets: [T] long; k: [T, H, D]."""
        P, g, H, D = self.kmax.shape
        if H == 0 or pages.numel() == 0:
            return
        slot = pages * g + torch.div(offsets, self.logical_page_size, rounding_mode="floor")  # [T]
        mx = self.kmax.view(P * g, H, D)
        mn = self.kmin.view(P * g, H, D)
        fresh = slot[offsets % self.logical_page_size == 0]
        mx[fresh] = float("-inf")
        mn[fresh] = float("inf")
        kk = k.to(mx.dtype)
        mx.index_reduce_(0, slot, kk, "amax", include_self=True)
        mn.index_reduce_(0, slot, kk, "amin", include_self=True)
