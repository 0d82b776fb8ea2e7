"""The host KV tier's GPU page cache: which of one layer's missed pages enter the resident set
(:class:`RepeatAdmission`), and in which order resident pages leave it (:class:`RecencyPolicy`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import numpy as np

ADMIT_ON_REPEAT = True
"""Whether a selection's misses enter the resident set only as :class:`RepeatAdmission` says
(else all of them, as far as slots allow). A switch for the host-tier bench to compare."""


class RepeatAdmission:
    """Which of a layer's missed picks a plan-time fetch installs (the cupy backend's decode).

    A decode kernel reads only its own head's part of a page on the host, and a selection is read
    for ``reads`` steps (the reuse interval C). A page k of the layer's n dense heads picked costs
    the host link k x C head parts if it stays on the host, and about k parts (read before the
    fetch lands) plus n (the whole page) if installed: installing pays when k x (C - 1) >= n (with
    4 dense heads and C = 4: two heads or more; with one dense head: always). A page the layer's
    previous selection missed too enters as well (one the selector keeps coming back to: a trained
    model's picks repeat, random weights' barely do); the others stay on the host and are
    remembered for the next selection.
    """

    def __init__(self) -> None:
        self._last = np.zeros(0, dtype=np.int64)  # pages the previous selection missed and left on the host

    def admit(self, miss: np.ndarray, heads: np.ndarray, n_heads: int, reads: int) -> np.ndarray:
        """Mask over ``miss`` (missed pages) of those to install; ``heads``: how many of the layer's
        ``n_heads`` dense heads picked each; ``reads``: steps that read the selection."""
        miss = np.asarray(miss, dtype=np.int64)
        ok = (np.asarray(heads) * (reads - 1) >= n_heads) | np.isin(miss, self._last, kind="table")
        self._last = miss[~ok]
        return ok


class RecencyPolicy:
    """Least recently selected (or written) resident page first, protected pages last.

    The tier calls :meth:`touch` whenever a page of the layer is made resident, selected or
    written, :meth:`forget` when it leaves the layer's resident set, and :meth:`victim` to pick
    the page whose slot a fetch takes. Pages of a sequence that is still prefilling are
    *protected* (:meth:`protect`, :meth:`unprotect`): its next chunk reads all of them, so they
    are evicted only when no unprotected page can be, oldest first (the past's front, which then
    comes back from the host as one contiguous range). Another policy (frequency, selector
    scores) is another class with these methods.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()  # resident pages, least recent first
        self._kept: OrderedDict[int, None] = OrderedDict()  # protected resident pages, oldest first

    def __len__(self) -> int:
        return len(self._order) + len(self._kept)

    def __contains__(self, page: int) -> bool:
        return page in self._order or page in self._kept

    def touch(self, pages: Iterable[int], protect: bool = False) -> None:
        """Mark ``pages`` (resident) as used now; ``protect``: new ones enter protected."""
        order, kept = self._order, self._kept
        for p in pages:
            if p in kept:
                kept.move_to_end(p)
            elif protect and p not in order:
                kept[p] = None  # new keys enter at the end
            else:
                order[p] = None
                order.move_to_end(p)

    def protect(self, pages: Iterable[int]) -> None:
        """Move resident ``pages`` (in this order) to the end of the protected ones."""
        for p in pages:
            if self._order.pop(p, 0) is None:
                self._kept[p] = None

    def unprotect(self, pages: Iterable[int]) -> None:
        """Move protected ``pages`` (in this order) back among the others, as most recent."""
        for p in pages:
            if self._kept.pop(p, 0) is None:
                self._order[p] = None

    def forget(self, page: int) -> None:
        """``page`` left the resident set."""
        if self._order.pop(page, 0) is not None:
            del self._kept[page]

    def victim(self, evictable: Callable[[int], bool]) -> int | None:
        """The least recent unprotected resident page that ``evictable`` accepts, else the oldest
        protected one, or None."""
        return next((p for d in (self._order, self._kept) for p in d if evictable(p)), None)
