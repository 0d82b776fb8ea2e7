"""Two-way paged KV cache: allocator, pools, key statistics and KV quantization."""

from lserve.cache.allocator import OutOfPages, PageAllocator
from lserve.cache.kv_cache import KVCache, StreamRing

__all__ = ["KVCache", "OutOfPages", "PageAllocator", "StreamRing"]
