"""RMSNorm, as the torch path of the forward and the fused kernels' self-check both use it."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] -> normalized, scaled by w; statistics in float32 as HF does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)
