"""The two-way paged KV cache: a dense-head pool with key statistics and a streaming-head
pool holding only sink pages plus a ring of local pages per sequence (O(1) in context).

Heads are permuted at load time so that, in every layer, KV heads ``[0, n_dense)`` are dense
and ``[n_dense, H_kv)`` are streaming (see :class:`lserve.sparsity.patterns.HeadLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lserve.cache.allocator import PageAllocator
from lserve.cache.key_stats import KeyStats
from lserve.cache.paged_pool import PagedPool
from lserve.cache.prefix_cache import PrefixCache
from lserve.config import CacheConfig, ModelConfig


@dataclass(frozen=True)
class StreamRing:
    """Where a streaming head's tokens live: logical page i < sink_pages stays in slot i;
    later pages cycle through ``local_pages`` ring slots (SPEC.md section 3)."""

    page_size: int
    sink_pages: int
    local_pages: int

    @property
    def num_slots(self) -> int:
        return self.sink_pages + self.local_pages

    def slot_of_page(self, i: torch.Tensor) -> torch.Tensor:
        """Ring slot of logical page index ``i`` (elementwise)."""
        sink = self.sink_pages
        return torch.where(i < sink, i, sink + (i - sink) % self.local_pages)

    def page_in_slot(self, length: int) -> list[int]:
        """For each slot, the logical page it holds once ``length`` tokens are written (-1: none)."""
        if length <= 0:
            return [-1] * self.num_slots
        last = (length - 1) // self.page_size
        out = [i if i <= last else -1 for i in range(self.sink_pages)]
        sink = self.sink_pages
        for r in range(self.local_pages):
            # The latest page i <= last with (i - sink) % local_pages == r.
            i = last - ((last - sink - r) % self.local_pages)
            out.append(i if i >= sink else -1)
        return out


class KVCache:
    """All layers' KV storage plus the page allocators of both pools.

    Parameters
    ----------
    n_dense : list[int]
        Dense KV heads per layer (the rest are streaming).
    sink_tokens, local_tokens : int
        Streaming window; both multiples of the page size.
    max_num_seqs : int
        Sequences that can hold streaming pages at once.
    prefix_cache : bool
        Index full prompt pages for reuse (:attr:`prefix`). With streaming heads this adds one
        *shadow* page per dense page to the streaming pool (ids ``shadow_base + dense page``):
        prefill also writes the streaming heads' K/V of every token there, so a request that
        reuses a cached prefix can have its ring (sink + local window) filled by copying
        (:meth:`fill_ring`). Recomputing the window instead is not exact: its tokens' K/V depend,
        through every layer's streaming heads, on the window before it.
    prefix_seed : bytes
        Hash-chain seed of the prefix cache.
    """

    def __init__(self, model: ModelConfig, cfg: CacheConfig, n_dense: list[int], sink_tokens: int,
                 local_tokens: int, max_num_seqs: int, dtype: torch.dtype, device, prefix_cache: bool = False,
                 prefix_seed: bytes = b"") -> None:
        self.cfg = cfg
        self.page_size = cfg.page_size
        self.n_dense = list(n_dense)
        self.n_stream = [model.num_kv_heads - n for n in n_dense]
        self.has_streaming = any(self.n_stream)
        # One spare ring page: the last `local` tokens can straddle local/N_P + 1 pages.
        self.ring = StreamRing(cfg.page_size, sink_tokens // cfg.page_size, local_tokens // cfg.page_size + 1)
        self.stream_pages_per_seq = self.ring.num_slots if self.has_streaming else 0
        self.dense_alloc = PageAllocator(cfg.num_pages)
        self.stream_alloc = PageAllocator(max_num_seqs * self.stream_pages_per_seq)
        self.prefix = PrefixCache(self.dense_alloc, cfg.page_size, prefix_seed, prefix_cache)
        # Shadow pages follow the ring pages in the streaming pool; None: there are none.
        self.shadow_base = self.stream_alloc.num_pages if prefix_cache and self.has_streaming else None
        n_stream_pages = self.stream_alloc.num_pages + (cfg.num_pages if self.shadow_base is not None else 0)
        D, N = model.head_dim, cfg.page_size
        self.dense = [PagedPool(cfg.num_pages, n, N, D, cfg.kv_quant, dtype, device) for n in n_dense]
        self.stats = [KeyStats(cfg.num_pages, n, N, cfg.logical_page_size, D, dtype, device) for n in n_dense]
        self.stream = [PagedPool(n_stream_pages, s, N, D, cfg.kv_quant, dtype, device) for s in self.n_stream]

    def pages_for(self, num_tokens: int) -> int:
        """Dense pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def fill_ring(self, ring_pages: list[int], dense_pages: list[int], length: int) -> None:
        """Copy, into a sequence's ring, the streaming K/V of its first ``length`` tokens held in
        the shadow pages of ``dense_pages`` (a prefix-cache hit; ``length`` ends a page)."""
        if self.shadow_base is None or length <= 0:
            return
        pairs = [(self.shadow_base + dense_pages[i], ring_pages[r])
                 for r, i in enumerate(self.ring.page_in_slot(length)) if i >= 0]
        src = [s for s, _ in pairs]
        dst = [d for _, d in pairs]
        for pool in self.stream:
            pool.copy_pages(src, dst)

    def nbytes(self) -> dict[str, int]:
        """Bytes held per pool."""
        return {
            "dense": sum(p.nbytes() for p in self.dense) + sum(s.nbytes() for s in self.stats),
            "streaming": sum(p.nbytes() for p in self.stream),
        }

    def usage(self) -> dict[str, float]:
        """Fraction of pages in use per pool (0 for an empty pool; idle cached pages count as free)."""
        def frac(a: PageAllocator) -> float:
            return a.num_used / a.num_pages if a.num_pages else 0.0
        return {"dense": frac(self.dense_alloc), "streaming": frac(self.stream_alloc)}

    def all_free(self) -> bool:
        """True when no page of either pool is held by a sequence (idle cached pages may remain)."""
        return self.dense_alloc.num_used == 0 and self.stream_alloc.num_used == 0
