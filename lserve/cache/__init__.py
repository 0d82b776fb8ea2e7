"""Two-way paged KV cache: allocator, pools, key statistics, KV quantization and the prefix cache.

``lserve.cache.page_hash`` needs no torch (the router imports it), so the torch-backed names
here are imported on first use.
"""

from lserve.cache.allocator import OutOfPages, PageAllocator

__all__ = ["KVCache", "OutOfPages", "PageAllocator", "PrefixCache", "StreamRing"]


def __getattr__(name: str):
    if name in ("KVCache", "StreamRing"):
        from lserve.cache import kv_cache

        return getattr(kv_cache, name)
    if name == "PrefixCache":
        from lserve.cache.prefix_cache import PrefixCache

        return PrefixCache
    raise AttributeError(f"module 'lserve.cache' has no attribute {name!r}")
