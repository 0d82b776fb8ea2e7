"""Physical page allocator: a free list of page ids shared by every layer of one pool."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Raised when a pool cannot satisfy an allocation (the scheduler preempts on it)."""


class PageAllocator:
    """Hands out integer page ids in ``[0, num_pages)``.

    Page ``p`` addresses the same slot in every layer's storage tensor, so one allocation
    serves the whole model.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Pop from the end: low ids first, which keeps fresh caches compact.
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages; raises :class:`OutOfPages` and takes nothing if not enough."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
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
