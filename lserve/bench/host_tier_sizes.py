"""Byte arithmetic of the host KV tier: what a token and a sequence take where, and how many
sequences (or how long one) a device and a host hold.

With the tier on, a dense-head page's K/V (and quantization scales) live either in the resident
pool on the device or in a host slot, while its key statistics (the selector's per-logical-page
min/max) stay on the device for every virtual page. So a virtual token costs the device
``stats_per_token`` wherever its K/V are, a resident one ``device_per_token``, and the host
``host_per_token``; streaming heads' rings are a constant per sequence on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from lserve.cache.host_tier import pinned_bound, stage_slots
from lserve.config import CacheConfig, EngineConfig, SparsityConfig


@dataclass(frozen=True)
class KVSizes:
    """Bytes of a model's KV cache under one sparsity and KV storage.

    Parameters
    ----------
    device_per_token : float
        Dense pool bytes per token on the device: K, V, scales and key statistics.
    host_per_token : float
        What the tier keeps per token on the host: K, V and scales.
    ring_per_seq : float
        The streaming heads' ring of one sequence (device).
    page_size : int
    sink_pages, local_pages : int
        The streaming window in pages (the pages each sequence pins with the tier).
    stage_entries : int
        Resident pages per sequence the cupy engine sets aside for staging a selection's picks
        (:func:`~lserve.cache.host_tier.stage_entries`; 0: none).
    """

    device_per_token: float
    host_per_token: float
    ring_per_seq: float
    page_size: int
    sink_pages: int
    local_pages: int
    stage_entries: int = 0

    @property
    def stats_per_token(self) -> float:
        """Device bytes a token's key statistics take, resident or not."""
        return self.device_per_token - self.host_per_token

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def pinned(self, max_batched_tokens: int, n_seqs: int) -> int:
        """Pages one step pins (:func:`~lserve.cache.host_tier.pinned_bound`)."""
        return pinned_bound(max_batched_tokens, n_seqs, self.page_size, self.sink_pages, self.local_pages)


def kv_sizes(model: str, model_cfg, sparsity: SparsityConfig, kv_quant: str, dtype, backend: str = "torch") -> KVSizes:
    """:class:`KVSizes` of a 4096-token cache of this configuration, built on the CPU (no weights),
    for an engine on ``backend`` (the cupy one sets a staging area aside)."""
    from lserve.engine.llm_engine import build_cache, build_layout, tier_stage_entries

    cfg = EngineConfig(model=model, sparsity=sparsity, cache=CacheConfig(dense_pool_tokens=4096, kv_quant=kv_quant),
                       max_num_seqs=2, prefix_cache=False)
    c = build_cache(cfg, model_cfg, build_layout(cfg, model_cfg), dtype)
    tokens = c.dense_alloc.num_pages * c.page_size
    host = sum(p.page_bytes() for p in c.dense) / c.page_size
    return KVSizes(c.nbytes()["dense"] / tokens, host, c.nbytes()["streaming"] / 2, c.page_size,
                   c.ring.sink_pages, c.ring.local_pages, tier_stage_entries(backend, sparsity, c.page_size))


def seqs_all_gpu(s: KVSizes, gpu_bytes: float, tokens_per_seq: int) -> int:
    """Sequences of ``tokens_per_seq`` tokens whose pages and rings fit ``gpu_bytes`` (no tier)."""
    return int(gpu_bytes // (s.pages(tokens_per_seq) * s.page_size * s.device_per_token + s.ring_per_seq))


def tier_split(s: KVSizes, gpu_bytes: float, host_bytes: float, n_seqs: int, max_batched_tokens: int) -> dict | None:
    """The tier's pools for ``n_seqs`` sequences: host pages (``host_bytes`` of them), the resident
    pages the rest of ``gpu_bytes`` holds beside every virtual page's key statistics and the rings,
    and the virtual pages they give (as the cupy engine's :class:`~lserve.cache.kv_cache.KVCache`
    counts them: less its staging area); None where the device cannot hold the pages one step pins."""
    page = s.page_size
    host_pages = int(host_bytes // (s.host_per_token * page))
    pinned = s.pinned(max_batched_tokens, n_seqs)
    if host_pages <= pinned:
        return None
    free = gpu_bytes - n_seqs * s.ring_per_seq - (host_pages - pinned) * page * s.stats_per_token
    resident = int(free // (page * s.device_per_token))
    if resident < pinned:
        return None
    staged = stage_slots(resident, pinned, n_seqs, s.stage_entries) * s.stage_entries
    return {"resident_pages": resident, "host_pages": host_pages, "pinned_pages": pinned, "staged_pages": staged,
            "virtual_pages": resident - staged + host_pages - pinned}


def seqs_tier(s: KVSizes, gpu_bytes: float, host_bytes: float, tokens_per_seq: int, max_batched_tokens: int) -> int:
    """Most sequences of ``tokens_per_seq`` tokens the tier's virtual pages hold (:func:`tier_split`)."""
    n = 0
    while True:
        split = tier_split(s, gpu_bytes, host_bytes, n + 1, max_batched_tokens)
        if split is None or split["virtual_pages"] < (n + 1) * s.pages(tokens_per_seq):
            return n
        n += 1


def engine_pools(s: KVSizes, gpu_bytes: float, host_bytes: float, n_seqs: int, max_batched_tokens: int,
                 tier: bool) -> tuple[int, float]:
    """``(dense pool tokens, host GiB)`` of an engine for ``n_seqs`` sequences: all-GPU, the pool
    that ``gpu_bytes`` holds beside their rings; with the tier, :func:`tier_split`'s resident set
    and host pages (half a page of slack, so the engine's own rounding keeps every page)."""
    if not tier:
        return int((gpu_bytes - n_seqs * s.ring_per_seq) // s.device_per_token), 0.0
    split = tier_split(s, gpu_bytes, host_bytes, n_seqs, max_batched_tokens)
    host_gib = (split["host_pages"] + 0.5) * s.page_size * s.host_per_token / 2**30
    return split["resident_pages"] * s.page_size, round(host_gib, 6)


def max_context(s: KVSizes, gpu_bytes: float, host_bytes: float, max_batched_tokens: int) -> dict:
    """Longest context one sequence can hold all on the device and with the tier (tokens)."""
    split = tier_split(s, gpu_bytes, host_bytes, 1, max_batched_tokens)
    gpu = int((gpu_bytes - s.ring_per_seq) // s.device_per_token)
    return {"gpu": gpu, "tier": split["virtual_pages"] * s.page_size if split else 0}
