"""The host KV tier's GPU page cache: which of one layer's missed pages enter the resident set
(:class:`RepeatAdmission`), and in which order resident pages leave it (:class:`RecencyPolicy`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from itertools import chain, islice

import numpy as np

ADMIT_ON_REPEAT = True
"""Whether a selection's misses enter the resident set only as :class:`RepeatAdmission` says
(else all of them, as far as slots allow). A switch for the host-tier bench to compare."""


PINNED = 4
"""Added to a pinned page's order index in :class:`RecencyPolicy` while it is out of the orders."""


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

    A *pinned* page (:meth:`pin`: one a step writes or a decoding window holds) cannot be evicted
    and is out of the orders until :meth:`unpin` puts it back as the most recent: the tier then
    pins and unpins only the pages whose state changed, where touching every pinned page of every
    layer each step cost ~7 ms a step (16 sequences x 32 layers).

    A *hot* page (no host copy) is dropped only after a spill, so the tier looks for clean
    victims first and says which pages are hot (:meth:`touch`'s ``hot``, :meth:`set_hot`). Hot
    and clean pages are kept in orders of their own, so the search for a clean victim never
    walks the hot ones: with most of the resident set hot (a full host), walking them once per
    installed page cost a selection's fetch installs x hot pages predicate calls (10 s a decode
    step, 16 x 128k on an H100). A page that turns clean (spilled) enters
    as the most recent clean page: mostly one that just left a decoding window, or a prefilling
    sequence's past in logical order.
    """

    def __init__(self) -> None:
        # least recent first: unprotected clean, unprotected hot, protected clean, protected hot
        self._orders: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(4)]
        # resident page -> index of its order (2 x protected + hot), plus PINNED while out of it
        self._in: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._in)

    def __contains__(self, page: int) -> bool:
        return page in self._in

    def _move(self, page: int, to: int) -> None:
        """``page`` to the end of order ``to`` (a pinned page: only its state changes)."""
        i = self._in[page]
        if i >= PINNED:
            self._in[page] = to + PINNED
            return
        del self._orders[i][page]
        self._orders[to][page] = None
        self._in[page] = to

    def touch(self, pages: Iterable[int], protect: bool = False, hot: bool = False) -> None:
        """Mark ``pages`` (resident) as used now; new ones enter protected if ``protect``, and
        hot (no host copy) if ``hot``."""
        orders, where, new = self._orders, self._in, 2 * protect + hot
        for p in pages:
            i = where.get(p)
            if i is None:
                where[p] = new
                orders[new][p] = None  # new keys enter at the end
            elif i < PINNED:  # a pinned page's recency is taken when it is unpinned
                orders[i].move_to_end(p)

    def protect(self, pages: Iterable[int]) -> None:
        """Move resident ``pages`` (in this order) to the end of the protected ones."""
        for p in pages:
            i = self._in.get(p)
            if i is not None and i % PINNED < 2:
                self._move(p, i % PINNED + 2)

    def unprotect(self, pages: Iterable[int]) -> None:
        """Move protected ``pages`` (in this order) back among the others, as most recent."""
        for p in pages:
            i = self._in.get(p)
            if i is not None and i % PINNED >= 2:
                self._move(p, i % PINNED - 2)

    def set_hot(self, page: int, hot: bool) -> None:
        """Resident ``page`` lost its host copy (``hot``) or got one: it goes to the end of the
        clean or hot pages (protected or not, as it was)."""
        i = self._in[page] % PINNED
        if i % 2 != hot:
            self._move(page, i - i % 2 + hot)

    def pin(self, pages: Iterable[int]) -> None:
        """Take resident ``pages`` out of the eviction orders (pages not held are skipped)."""
        orders, where = self._orders, self._in
        for p in pages:
            i = where.get(p)
            if i is not None and i < PINNED:
                del orders[i][p]
                where[p] = i + PINNED

    def unpin(self, pages: Iterable[int]) -> None:
        """Put pinned ``pages`` back (in this order) as the most recent of their kind."""
        orders, where = self._orders, self._in
        for p in pages:
            i = where.get(p)
            if i is not None and i >= PINNED:
                orders[i - PINNED][p] = None
                where[p] = i - PINNED

    def pages(self, hot: bool) -> set[int]:
        """Every resident page that is hot (``hot``) or clean, pinned ones too."""
        return {p for p, i in self._in.items() if i % 2 == hot}

    def forget(self, page: int) -> None:
        """``page`` left the resident set."""
        self.forget_many((page,))

    def candidates(self, hot: bool = False) -> Iterator[int]:
        """The clean (``hot``: the hot) resident pages in eviction order, pinned ones left out:
        unprotected least recent first, then protected oldest first."""
        return chain(self._orders[hot], self._orders[2 + hot])

    def victim(self, evictable: Callable[[int], bool], hot: bool = False) -> int | None:
        """The first of :meth:`candidates` (clean ones, or ``hot`` ones) that ``evictable`` accepts,
        or None."""
        return next((p for p in self.candidates(hot) if evictable(p)), None)

    def victims(self, n: int, evictable: Callable[[int], bool]) -> list[int]:
        """The first ``n`` clean :meth:`candidates` that ``evictable`` accepts (fewer where there
        are not as many): the victims of ``n`` calls of :meth:`victim` with each one forgotten, in
        one walk of the order (a fetch's installs; each call would walk past the same refused
        pages again)."""
        return list(islice((p for p in self.candidates() if evictable(p)), n)) if n > 0 else []

    def forget_many(self, pages: Iterable[int]) -> None:
        """:meth:`forget` each of ``pages``."""
        orders, where = self._orders, self._in
        for p in pages:
            i = where.pop(p)
            if i < PINNED:
                del orders[i][p]
