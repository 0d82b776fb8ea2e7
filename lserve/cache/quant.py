"""KV quantization: INT8 (symmetric) and INT4 (asymmetric, packed) per token and head.

Layouts (the CUDA kernels read the same bytes):

* INT8: ``q`` int8 ``[..., D]``, ``scale`` float32 ``[...]``; ``x ~= q * scale``.
* INT4: ``q`` uint8 ``[..., D/2]`` with element ``2i`` in the low nibble and ``2i+1`` in the
  high nibble, ``scale`` and ``zero`` float32 ``[...]``; ``x ~= nibble * scale + zero``.
"""

from __future__ import annotations

import torch

_EPS = 1e-8


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 over the last dim. x: [..., D] -> (int8 [..., D], float32 [...])."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(_EPS) / 127.0
    q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`. q: [..., D], scale: [...] -> dtype [..., D]."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric INT4 over the last dim, two values per byte.

    x: [..., D] -> (uint8 [..., D/2], scale float32 [...], zero float32 [...]).
    """
    xf = x.float()
    lo = xf.amin(dim=-1)
    hi = xf.amax(dim=-1)
    scale = (hi - lo).clamp_min(_EPS) / 15.0
    q = torch.round((xf - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed, scale, lo


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_int4`. packed: [..., D/2] -> dtype [..., D]."""
    low = (packed & 0xF).float()
    high = (packed >> 4).float()
    q = torch.stack((low, high), dim=-1).flatten(-2)  # [..., D], interleaved back
    return (q * scale.unsqueeze(-1) + zero.unsqueeze(-1)).to(dtype)
