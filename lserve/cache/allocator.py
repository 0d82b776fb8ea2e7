"""Physical page allocator: a free list of page ids shared by every layer of one pool."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Reclaimer(Protocol):
    """Holds allocated pages that nobody reads and gives them back on demand (the prefix cache)."""

    @property
    def num_evictable(self) -> int: ...

    def evict(self, n: int) -> None:
        """Return at least ``n`` held pages to the allocator (``PageAllocator.free``)."""


class OutOfPages(RuntimeError):
    """Raised when a pool cannot satisfy an allocation (the scheduler preempts on it)."""


class PageAllocator:
    """Hands out integer page ids in ``[0, num_pages)``.

    Page ``p`` addresses the same slot in every layer's storage tensor, so one allocation
    serves the whole model. With a :class:`Reclaimer` attached (``reclaimer``), pages it holds
    unreferenced count as free: an allocation that needs them makes it evict them first.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Pop from the end: low ids first, which keeps fresh caches compact.
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()
        self.reclaimer: Reclaimer | None = None
        #: Told of every freed batch of pages (the host KV tier gives back their slots).
        self.on_free: Callable[[list[int]], None] | None = None

    def _evictable(self) -> int:
        return self.reclaimer.num_evictable if self.reclaimer is not None else 0

    @property
    def num_free(self) -> int:
        """Pages an allocation can get: free ones plus those the reclaimer would evict."""
        return len(self._free) + self._evictable()

    @property
    def num_used(self) -> int:
        """Pages some sequence holds (cached pages nobody reads are not counted)."""
        return len(self._used) - self._evictable()

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages (evicting unreferenced cached pages if the free list is short);
        raises :class:`OutOfPages` and takes nothing if not enough."""
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} free of {self.num_pages}")
        if n > len(self._free):
            self.reclaimer.evict(n - len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool; freeing a page twice is a bug and raises."""
        for p in pages:
            if p not in self._used:
                raise RuntimeError(f"page {p} freed twice or never allocated")
            self._used.remove(p)
            self._free.append(p)
        if self.on_free is not None:
            self.on_free(pages)
