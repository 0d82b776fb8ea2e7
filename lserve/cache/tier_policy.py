"""Eviction order of one layer's resident dense pages (the host KV tier's GPU page cache)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable


class RecencyPolicy:
    """Least recently selected (or written) resident page first.

    The tier calls :meth:`touch` whenever a page of the layer is made resident, selected or
    written, :meth:`forget` when it leaves the layer's resident set, and :meth:`victim` to pick
    the page whose slot a fetch takes. Another policy (frequency, selector scores) is another
    class with these three methods.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()  # resident pages, least recent first

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, page: int) -> bool:
        return page in self._order

    def touch(self, pages: Iterable[int]) -> None:
        """Mark ``pages`` (resident) as used now."""
        for p in pages:
            self._order[p] = None
            self._order.move_to_end(p)

    def forget(self, page: int) -> None:
        """``page`` left the resident set."""
        del self._order[page]

    def victim(self, evictable: Callable[[int], bool]) -> int | None:
        """The least recent resident page that ``evictable`` accepts, or None."""
        return next((p for p in self._order if evictable(p)), None)
