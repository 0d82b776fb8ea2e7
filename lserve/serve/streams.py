"""Async combinators over the engine's event streams: all choices' events as they come, and
keep-alive markers in the silences between them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from lserve.serve.admission import SubRequest


def abandon(pending: asyncio.Future | None) -> None:
    """Cancel a still-pending ``__anext__`` of a stream nobody will read again, and retrieve its
    outcome when it ends, or at once if it already ended (a cancelled engine call over gRPC ends
    with ``RequestCancelledError``, not a cancellation), so asyncio logs no "exception was never
    retrieved"."""
    if pending is None:
        return
    if not pending.done():
        pending.cancel()
    pending.add_done_callback(lambda t: t.cancelled() or t.exception())

#: What :func:`keepalives` puts between events after a silent interval, and the SSE comment line
#: sent for it (clients ignore comment lines).
KEEPALIVE = object()
SSE_KEEPALIVE = ": keep-alive\n\n"


async def merged_events(subs: list[SubRequest]) -> AsyncIterator[tuple[SubRequest, dict[str, Any]]]:
    """Events of all choices as they come (after each stream's first event)."""
    if len(subs) == 1:
        sub = subs[0]
        async for ev in sub.stream:
            yield sub, ev
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(sub: SubRequest) -> None:
        try:
            async for ev in sub.stream:
                q.put_nowait((sub, ev))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((sub, e))
        finally:
            q.put_nowait((sub, done))

    tasks = [asyncio.ensure_future(pump(s)) for s in subs]
    try:
        remaining = len(subs)
        while remaining:
            sub, ev = await q.get()
            if ev is done:
                remaining -= 1
            elif isinstance(ev, BaseException):
                raise ev
            else:
                yield sub, ev
    finally:
        for t in tasks:
            t.cancel()


async def keepalives(events: AsyncIterator, interval_s: float) -> AsyncIterator:
    """``events``, with :data:`KEEPALIVE` in between each time ``interval_s`` passes without one
    (0: never): a stream waiting in the engine's queue or for a long prefill still sends bytes,
    so proxies and load balancers with idle timeouts keep the connection."""
    if interval_s <= 0:
        async for item in events:
            yield item
        return
    it = events.__aiter__()
    nxt: asyncio.Future | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            while not (await asyncio.wait((nxt,), timeout=interval_s))[0]:
                yield KEEPALIVE
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        abandon(nxt)  # our consumer was cancelled (client gone)
