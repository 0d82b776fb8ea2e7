"""Storage of K/V for one group of heads of one layer, in physical pages.

Shapes (P pages, H heads, N_P tokens per page, D head dim):

* ``none``: ``k, v`` [P, H, N_P, D] in the model dtype.
* ``int8``: ``k, v`` int8 [P, H, N_P, D]; ``k_scale, v_scale`` float32 [P, H, N_P].
* ``int4``: ``k, v`` uint8 [P, H, N_P, D/2]; scales and zeros float32 [P, H, N_P].
"""

from __future__ import annotations

import torch

from lserve.cache import quant


class PagedPool:
    """K/V pages for ``num_heads`` KV heads, optionally quantized."""

    def __init__(self, num_pages: int, num_heads: int, page_size: int, head_dim: int,
                 kv_quant: str, dtype: torch.dtype, device: torch.device | str, alloc=None) -> None:
        """``alloc(shape, dtype)``: makes each zeroed storage tensor (None: ``torch.zeros`` on
        ``device``; the host KV tier passes mapped host memory, :mod:`lserve.cache.host_memory`)."""
        zeros = alloc or (lambda shape, dt: torch.zeros(shape, dtype=dt, device=device))
        self.num_heads, self.page_size, self.head_dim = num_heads, page_size, head_dim
        self.num_pages = num_pages
        self._head_rows: torch.Tensor | None = None  # long [H, 1]: gather rows of sequence_kv
        self.kv_quant, self.dtype = kv_quant, dtype
        shape = (num_pages, num_heads, page_size)
        if kv_quant == "none":
            store_d, store_t = head_dim, dtype
        elif kv_quant == "int8":
            store_d, store_t = head_dim, torch.int8
        else:
            store_d, store_t = head_dim // 2, torch.uint8
        self.k = zeros((*shape, store_d), store_t)
        self.v = zeros((*shape, store_d), store_t)
        self.k_scale = self.v_scale = self.k_zero = self.v_zero = None
        if kv_quant != "none":
            self.k_scale = zeros(shape, torch.float32)
            self.v_scale = zeros(shape, torch.float32)
        if kv_quant == "int4":
            self.k_zero = zeros(shape, torch.float32)
            self.v_zero = zeros(shape, torch.float32)

    def tensors(self) -> list[torch.Tensor]:
        """The storage tensors (data, then scales and zero points where quantized), page-major."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale, self.k_zero, self.v_zero) if t is not None]

    def nbytes(self) -> int:
        """Bytes held by this pool (data + scales)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def page_bytes(self) -> int:
        """Bytes of one page (data + scales)."""
        return sum(t[:1].numel() * t.element_size() for t in self.tensors()) if self.num_pages else 0

    def write(self, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store tokens. pages, offsets: [T] long; k, v: [T, H, D]."""
        if self.num_heads == 0 or pages.numel() == 0:
            return
        for data, scale, zero, x in ((self.k, self.k_scale, self.k_zero, k), (self.v, self.v_scale, self.v_zero, v)):
            if self.kv_quant == "none":
                data[pages, :, offsets] = x.to(self.dtype)
            elif self.kv_quant == "int8":
                q, s = quant.quantize_int8(x)
                data[pages, :, offsets] = q
                scale[pages, :, offsets] = s
            else:
                q, s, z = quant.quantize_int4(x)
                data[pages, :, offsets] = q
                scale[pages, :, offsets] = s
                zero[pages, :, offsets] = z

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages ``src[i] -> dst[i]`` (data, scales, zero points), on the pool's device."""
        if self.num_heads == 0 or not src:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.k.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.k.device)
        for t in (self.k, self.v, self.k_scale, self.v_scale, self.k_zero, self.v_zero):
            if t is not None:
                t[d] = t[s]  # [n, H, N_P, ...] rows

    def gather(self, pages: torch.Tensor, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V of chosen pages per head, head-major.

        pages: [R, C] long, heads: [R, 1] long (row r reads pages[r] of head heads[r])
        -> two [R, C, N_P, D] tensors (contiguous, so ``view(R, C * N_P, D)`` is free).
        """
        def one(data, scale, zero):
            if self.kv_quant == "none":
                return data[pages, heads]
            if self.kv_quant == "int8":
                return quant.dequantize_int8(data[pages, heads], scale[pages, heads], self.dtype)
            return quant.dequantize_int4(data[pages, heads], scale[pages, heads], zero[pages, heads], self.dtype)

        return one(self.k, self.k_scale, self.k_zero), one(self.v, self.v_scale, self.v_zero)

    def sequence_kv(self, pages: torch.Tensor, length: int,
                    page_list: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V of positions [0, length) of one sequence, every head of the pool.

        pages: [>= ceil(length / N_P)] long, the sequence's pages in order -> two [H, length, D].
        ``page_list``: the same ids on the host (unused here; the host KV tier's view reads by them).
        """
        h = self.num_heads
        heads = self._head_rows
        if heads is None or heads.device != pages.device:  # built once: one launch less per layer and chunk
            heads = self._head_rows = torch.arange(h, device=pages.device)[:, None]  # [H, 1]
        k, v = self.gather(pages[: -(-length // self.page_size)].expand(h, -1), heads)  # [H, n, N_P, D]
        d = k.shape[-1]
        return k.view(h, -1, d)[:, :length], v.view(h, -1, d)[:, :length]

    def pages_view(self, pages: torch.Tensor, page_list: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V of whole pages in pool layout: two [n, H, N_P, D].

        A view of the pool (no copy) when the pages are consecutive and unquantized, which
        ``page_list`` (the same ids on the host) lets us check without a device sync.
        """
        n = pages.numel()
        if self.kv_quant == "none" and page_list is not None and n:
            p0 = page_list[0]
            if page_list[n - 1] - p0 == n - 1 and all(b - a == 1 for a, b in zip(page_list[: n - 1], page_list[1:n])):
                return self.k[p0: p0 + n], self.v[p0: p0 + n]
        return self.read(pages)

    def read_tokens(self, pages: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V of single tokens. pages, offsets: [R] long -> two [R, H, D] tensors."""
        def one(data, scale, zero):
            if self.kv_quant == "none":
                return data[pages, :, offsets]
            if self.kv_quant == "int8":
                return quant.dequantize_int8(data[pages, :, offsets], scale[pages, :, offsets], self.dtype)
            return quant.dequantize_int4(data[pages, :, offsets], scale[pages, :, offsets], zero[pages, :, offsets],
                                         self.dtype)

        return one(self.k, self.k_scale, self.k_zero), one(self.v, self.v_scale, self.v_zero)

    def read(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V of whole pages. pages: [n] long -> two [n, H, N_P, D] tensors."""
        return self._read(self.k, self.k_scale, self.k_zero, pages), self._read(self.v, self.v_scale, self.v_zero, pages)

    def _read(self, data, scale, zero, pages):
        if self.kv_quant == "none":
            return data[pages]
        if self.kv_quant == "int8":
            return quant.dequantize_int8(data[pages], scale[pages], self.dtype)
        return quant.dequantize_int4(data[pages], scale[pages], zero[pages], self.dtype)
