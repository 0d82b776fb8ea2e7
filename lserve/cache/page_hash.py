"""Chained hashes of full KV pages of token ids: the prefix cache's keys and the router's.

Plain Python (no torch), so the serving layer's router computes the same keys as the engine
without loading the engine. ``h[i]`` covers tokens ``[0, (i + 1) * page_size)`` together with a
*seed* naming everything else that changes a page's K/V (model, dtype, KV quantization, head
pattern, streaming window, page size): two prompts share ``h[i]`` exactly when they share that
whole prefix under the same seed (hash collisions aside; the engine compares token ids on a hit).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Mapping, Sequence
from typing import Any


def namespace_seed(parts: Mapping[str, Any]) -> bytes:
    """16-byte seed of a hash chain from the settings that change page contents (JSON-able values)."""
    text = json.dumps(dict(parts), sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"lserve-prefix").digest()


def page_hashes(tokens: Sequence[int], page_size: int, seed: bytes, max_pages: int | None = None) -> list[int]:
    """Chained 64-bit hashes of the full ``page_size``-token pages of ``tokens``.

    Parameters
    ----------
    tokens : sequence of int
        Token ids; a trailing partial page is not hashed.
    page_size : int
        Tokens per physical KV page (N_P).
    seed : bytes
        :func:`namespace_seed` of the engine's settings.
    max_pages : int, optional
        Hash at most this many leading pages.

    Returns
    -------
    list of int
        One unsigned 64-bit value per page; stable across processes (BLAKE2b over the previous
        digest and the page's ids as int64).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    n = len(tokens) // page_size
    if max_pages is not None:
        n = min(n, max_pages)
    out: list[int] = []
    prev = seed
    for i in range(n):
        block = array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        out.append(int.from_bytes(prev[:8], "big"))
    return out
