"""Prefix cache: an index of full dense KV pages by the chained hash of their token ids.

A page enters the index once all its tokens are prompt tokens whose K/V are written; a new
request then reuses the longest run of indexed pages its prompt starts with, instead of
recomputing them. What lives per physical dense page travels with it untouched: the dense
heads' K/V, their INT8/INT4 scales and zero points, and the key statistics the page selector
reads. Streaming heads keep no per-page state in the dense pool; their K/V of cached pages are
kept in *shadow* pages (see :class:`~lserve.cache.kv_cache.KVCache`), from which a hit's ring
(sink + local window) is filled.

Safety:

* A hit is verified, never trusted: an entry matches page ``i`` of a prompt only if its token
  ids equal the prompt's and its parent entry is the one matched for page ``i - 1`` (object
  identity), so by induction the whole prefix is equal token for token. A hash collision only
  loses a hit.
* Pages carry reference counts (sequences reading them). Release decrements; an unreferenced
  cached page is not freed but parked in an LRU list, and given back to the allocator only when
  an allocation needs it (:meth:`evict`, called by :class:`~lserve.cache.allocator.PageAllocator`).
  A referenced page is never evicted, so preemption or abort of one reader never frees a page
  another one reads.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from lserve.cache.allocator import PageAllocator
from lserve.cache.page_hash import page_hashes


@dataclass(eq=False)
class CachedPage:
    """One indexed physical page: its hash, token ids, the entry of the page before it, readers."""

    hash: int
    page: int
    tokens: tuple[int, ...]
    parent: CachedPage | None
    refs: int = 0


@dataclass
class PrefixStats:
    """Cumulative counters (vLLM's meaning: queried and hit prompt tokens at admission)."""

    queries: int = 0  # prompt tokens of admitted requests that looked the cache up
    hits: int = 0  # of those, tokens whose K/V came from the cache
    evictions: int = 0  # cached pages given back to the allocator
    inserted: int = 0  # pages put into the index
    recent_evicted: deque = field(default_factory=lambda: deque(maxlen=4096))  # (time, hash)


class PrefixCache:
    """Page-hash index over one dense pool, with reference counts and an LRU of idle pages.

    Parameters
    ----------
    alloc : PageAllocator
        The dense pool's allocator; this cache becomes its reclaimer.
    page_size : int
        Tokens per physical page (N_P).
    seed : bytes
        Hash-chain seed (:func:`~lserve.cache.page_hash.namespace_seed` of the engine's settings).
    enabled : bool
        False: nothing is ever indexed, :meth:`match` finds nothing, pages are freed on release.
    """

    def __init__(self, alloc: PageAllocator, page_size: int, seed: bytes, enabled: bool = True) -> None:
        self.alloc = alloc
        self.page_size = page_size
        self.seed = seed
        self.enabled = enabled
        self.stats = PrefixStats()
        self._index: dict[int, CachedPage] = {}  # hash -> the entry lookups find
        self._by_page: dict[int, CachedPage] = {}  # page -> entry (including entries shadowed in _index)
        self._idle: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, least recent first
        alloc.reclaimer = self

    # -- what the allocator asks ---------------------------------------------------------------
    @property
    def num_evictable(self) -> int:
        return len(self._idle)

    @property
    def num_cached(self) -> int:
        """Pages held by the cache (referenced or not)."""
        return len(self._by_page)

    def evict(self, n: int) -> None:
        """Give the ``n`` least recently used idle pages back to the allocator."""
        now = time.time()
        for _ in range(min(n, len(self._idle))):
            page, _ = self._idle.popitem(last=False)
            e = self._by_page.pop(page)
            if self._index.get(e.hash) is e:
                del self._index[e.hash]
                self.stats.recent_evicted.append((now, e.hash))
            self.stats.evictions += 1
            self.alloc.free([page])

    # -- lookups ------------------------------------------------------------------------------
    def hashes(self, tokens: Sequence[int], max_pages: int | None = None) -> list[int]:
        """:func:`~lserve.cache.page_hash.page_hashes` of ``tokens`` under this cache's seed."""
        return page_hashes(tokens, self.page_size, self.seed, max_pages)

    def match(self, tokens: Sequence[int], hashes: Sequence[int], max_pages: int) -> list[CachedPage]:
        """The longest verified run of cached pages that ``tokens`` starts with (at most ``max_pages``)."""
        out: list[CachedPage] = []
        if not self.enabled:
            return out
        N, parent = self.page_size, None
        for i in range(min(max_pages, len(hashes))):
            e = self._index.get(hashes[i])
            if e is None or e.parent is not parent or e.tokens != tuple(tokens[i * N:(i + 1) * N]):
                break
            out.append(e)
            parent = e
        return out

    # -- references ---------------------------------------------------------------------------
    def acquire(self, entries: Sequence[CachedPage]) -> list[int]:
        """Take a reference on each matched entry (an idle one leaves the LRU); their pages."""
        for e in entries:
            if e.refs == 0:
                del self._idle[e.page]
            e.refs += 1
        return [e.page for e in entries]

    def release(self, pages: Sequence[int]) -> None:
        """A sequence drops ``pages``: cached ones lose a reference (idle at zero), others are freed.

        The tail is parked first, so it is evicted before the head of the same prefix (a prefix
        without its head is unreachable).
        """
        private = []
        for p in reversed(pages):
            e = self._by_page.get(p)
            if e is None:
                private.append(p)
                continue
            e.refs -= 1
            if e.refs == 0:
                self._idle[p] = None
        if private:
            self.alloc.free(private)

    def insert(self, tokens: Sequence[int], hashes: Sequence[int], pages: Sequence[int], start: int,
               parent: CachedPage | None) -> CachedPage | None:
        """Index pages ``start .. len(hashes) - 1`` of a sequence that holds (one reference to) ``pages``.

        Parameters
        ----------
        tokens : sequence of int
            The sequence's prompt; pages ``< len(hashes)`` are full and written.
        hashes : sequence of int
            Chained hashes of those pages.
        pages : sequence of int
            The sequence's dense pages (logical order).
        start : int
            Pages before this one were handled by an earlier call.
        parent : CachedPage or None
            The entry standing for page ``start - 1`` (None when ``start`` is 0).

        Returns
        -------
        CachedPage or None
            The entry standing for the last page handled (the next call's ``parent``).
        """
        if not self.enabled:
            return parent
        N = self.page_size
        for i in range(start, len(hashes)):
            page, toks = pages[i], tuple(tokens[i * N:(i + 1) * N])
            own = self._by_page.get(page)
            if own is not None:  # already indexed (a hit, or an earlier call)
                parent = own
                continue
            e = self._index.get(hashes[i])
            if e is not None and e.parent is parent and e.tokens == toks:
                parent = e  # another sequence cached the same prefix first: ours stays private
                continue
            # New, or the entry there is stale (its parent was evicted) or a collision: ours wins.
            e = CachedPage(hashes[i], page, toks, parent, refs=1)
            self._index[e.hash] = e
            self._by_page[page] = e
            self.stats.inserted += 1
            parent = e
        return parent

    def recent_evictions(self, since: float) -> list[int]:
        """Hashes dropped from the index at or after wall time ``since`` (newest last)."""
        return [h for t, h in self.stats.recent_evicted if t >= since]
