"""The two-way paged KV cache: a dense-head pool with key statistics and a streaming-head
pool holding only sink pages plus a ring of local pages per sequence (O(1) in context).

Heads are permuted at load time so that, in every layer, KV heads ``[0, n_dense)`` are dense
and ``[n_dense, H_kv)`` are streaming (see :class:`lserve.sparsity.patterns.HeadLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lserve.cache.allocator import PageAllocator
from lserve.cache.host_tier import HostTier, pinned_bound, stage_slots
from lserve.cache.key_stats import KeyStats
from lserve.cache.paged_pool import PagedPool
from lserve.cache.prefix_cache import PrefixCache
from lserve.cache.tiered_pool import TieredPool
from lserve.config import CacheConfig, ConfigError, ModelConfig


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
    max_batched_tokens : int
        Tokens a step carries at most (sizes the pages a step pins with the host tier on).
    host_device : torch.device or str
        Where the host tier's pages live (``cfg.host_kv_gib`` > 0); ``"mapped"``: pinned host
        memory mapped into the cache device's address space (:mod:`lserve.cache.host_memory`), with
        the tier's page table mirrored on the device for the kernels (the cupy backend).
    host_mirror : bool
        Mirror the page table and batch the copies also for another ``host_device`` (tests of the
        cupy backend's bookkeeping on the CPU).
    """

    def __init__(self, model: ModelConfig, cfg: CacheConfig, n_dense: list[int], sink_tokens: int,
                 local_tokens: int, max_num_seqs: int, dtype: torch.dtype, device, prefix_cache: bool = False,
                 prefix_seed: bytes = b"", max_batched_tokens: int = 0, host_device="cpu",
                 host_mirror: bool = False, stage_entries: int = 0) -> None:
        self.cfg = cfg
        self.page_size = cfg.page_size
        self.n_dense = list(n_dense)
        self.n_stream = [model.num_kv_heads - n for n in n_dense]
        self.has_streaming = any(self.n_stream)
        # One spare ring page: the last `local` tokens can straddle local/N_P + 1 pages.
        self.ring = StreamRing(cfg.page_size, sink_tokens // cfg.page_size, local_tokens // cfg.page_size + 1)
        self.stream_pages_per_seq = self.ring.num_slots if self.has_streaming else 0
        D, N = model.head_dim, cfg.page_size
        self.dense = [PagedPool(cfg.num_pages, n, N, D, cfg.kv_quant, dtype, device) for n in n_dense]
        self.device = self.dense[0].k.device  # as the tensors have it (cuda:0, not cuda)
        #: The host tier's page table (None: off); the dense pools are then virtual-page views.
        self.host_tier: HostTier | None = None
        num_pages = cfg.num_pages  # dense page ids (virtual ones with the host tier)
        if cfg.host_kv_gib:
            num_pages = self._build_host_tier(cfg, max_num_seqs, max_batched_tokens, host_device, host_mirror,
                                              stage_entries)
        self.dense_alloc = PageAllocator(num_pages)
        if self.host_tier is not None:
            self.dense_alloc.on_free = self.host_tier.on_free
        self.stream_alloc = PageAllocator(max_num_seqs * self.stream_pages_per_seq)
        self.prefix = PrefixCache(self.dense_alloc, cfg.page_size, prefix_seed, prefix_cache)
        # Shadow pages follow the ring pages in the streaming pool; None: there are none.
        self.shadow_base = self.stream_alloc.num_pages if prefix_cache and self.has_streaming else None
        n_stream_pages = self.stream_alloc.num_pages + (num_pages if self.shadow_base is not None else 0)
        self.stats = [KeyStats(num_pages, n, N, cfg.logical_page_size, D, dtype, device) for n in n_dense]
        self.stream = [PagedPool(n_stream_pages, s, N, D, cfg.kv_quant, dtype, device) for s in self.n_stream]

    def _build_host_tier(self, cfg: CacheConfig, max_num_seqs: int, max_batched_tokens: int, host_device,
                         mirror: bool, stage_entries: int) -> int:
        """Host pools of ``cfg.host_kv_gib`` and the tier over them; returns the virtual page count
        (resident + host pages, less the pages one step may pin and, with mapped host pools and
        ``stage_entries``, the decode kernels' staging area: see ``docs/host_kv_tier.md``)."""
        resident = self.dense
        page_bytes = sum(p.page_bytes() for p in resident)
        if not page_bytes:
            raise ConfigError("the host KV tier holds dense heads' pages, and this head layout has none")
        host_pages = int(cfg.host_kv_gib * 2**30 // page_bytes)
        pinned = pinned_bound(max_batched_tokens, max_num_seqs, cfg.page_size, self.ring.sink_pages,
                              self.ring.local_pages)
        if cfg.num_pages < pinned:
            raise ConfigError(f"with the host KV tier the device must hold the pages one step pins: {pinned} pages "
                              f"({pinned * cfg.page_size} tokens, from max_batched_tokens, max_num_seqs and the "
                              f"sink/local window), but --max-cache-tokens gives {cfg.num_pages}")
        if host_pages <= pinned:
            raise ConfigError(f"--host-kv-gib {cfg.host_kv_gib:g} holds {host_pages} pages of {page_bytes} bytes, "
                              f"no more than the {pinned} a step pins: it adds no capacity")
        d0 = resident[0]
        host, views = [], None
        if host_device == "mapped":
            from lserve.cache.host_memory import MappedAllocator

            host_device, mirror, views = self.device, True, []
        for p in resident:
            alloc = MappedAllocator(self.device) if views is not None else None
            host.append(PagedPool(host_pages, p.num_heads, p.page_size, d0.head_dim, p.kv_quant, p.dtype, host_device,
                                  alloc=alloc))
            if alloc is not None:
                views.append(alloc.cpu)
        n_stage = stage_slots(cfg.num_pages, pinned, max_num_seqs, stage_entries) if mirror else 0
        virtual = cfg.num_pages - n_stage * stage_entries + host_pages - pinned
        self.host_tier = HostTier(resident, host, virtual, cfg.page_size, self.ring.sink_pages, self.ring.local_pages,
                                  mirror=mirror, host_views=views, stage_slots=n_stage, stage_entries=stage_entries)
        self.dense = [TieredPool(self.host_tier, i, r, h) for i, (r, h) in enumerate(zip(resident, host))]
        return virtual

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
        out = {
            "dense": sum(p.nbytes() for p in self.dense) + sum(s.nbytes() for s in self.stats),
            "streaming": sum(p.nbytes() for p in self.stream),
        }
        if self.host_tier is not None:
            out["host"] = sum(p.host_nbytes() for p in self.dense)
        return out

    def usage(self) -> dict[str, float]:
        """Fraction of pages in use per pool (0 for an empty pool; idle cached pages count as free)."""
        def frac(a: PageAllocator) -> float:
            return a.num_used / a.num_pages if a.num_pages else 0.0
        return {"dense": frac(self.dense_alloc), "streaming": frac(self.stream_alloc)}

    def all_free(self) -> bool:
        """True when no page of either pool is held by a sequence (idle cached pages may remain)."""
        return self.dense_alloc.num_used == 0 and self.stream_alloc.num_used == 0
