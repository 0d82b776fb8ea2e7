"""Drain state of the ingress: requests in flight, refusal of new ones, the cut of the rest.

A shutdown (the ingress deployment's ``drain``) or ``POST /admin/drain`` starts one drain; the
middleware refuses new requests while it runs and :meth:`Lifecycle.until_cut` ends the streams
still running when its grace period is over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from lserve.serve.protocol import OpenAIError
from lserve.serve.streams import abandon

log = logging.getLogger("lserve.serve")


class Lifecycle:
    """Drain state of one ingress replica: requests in flight, refusal of new ones, the cut.

    A drain (started by the shutdown path through :meth:`drain`, or by ``POST /admin/drain``
    through :meth:`begin_drain`; whichever comes first sets the grace period, and there is only
    ever one) makes :class:`~lserve.serve.middleware.GuardMiddleware` refuse new requests with 503, waits for the
    requests in flight to finish up to the grace period, then sets ``cut``: streams still
    running end with an SSE error event and ``data: [DONE]`` (:meth:`until_cut`),
    and non-streaming requests get a 503. A drained ingress stays drained until it restarts.
    """

    #: Seconds the cut streams get to write their final events before the drain returns.
    CUT_FLUSH_S = 5.0

    def __init__(self) -> None:
        self.in_flight = 0
        self.draining = False
        self._cut: asyncio.Event | None = None  # made on first use, in the serving event loop
        self._task: asyncio.Task | None = None
        self._grace_s = 0.0
        self._started_at = 0.0
        self._started_in_flight = 0

    @property
    def cut(self) -> asyncio.Event:
        if self._cut is None:
            self._cut = asyncio.Event()
        return self._cut

    async def _wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight == 0

    async def _run(self, grace_s: float) -> dict[str, Any]:
        started = self.in_flight
        if await self._wait_idle(grace_s):
            return {"in_flight": started, "cut": 0, "left": 0, "grace_s": grace_s}
        cut = self.in_flight
        log.warning("drain grace period (%.0fs) over: ending %d request(s) with an error", grace_s, cut)
        self.cut.set()
        await self._wait_idle(self.CUT_FLUSH_S)
        return {"in_flight": started, "cut": cut, "left": self.in_flight, "grace_s": grace_s}

    def begin_drain(self, grace_s: float) -> bool:
        """Start the drain unless one runs or ran already (call from the serving event loop).

        Returns
        -------
        bool
            True when this call started it.
        """
        if self._task is not None:
            return False
        self.draining = True  # before anything awaits: no request gets in after this
        self._grace_s, self._started_at, self._started_in_flight = grace_s, time.monotonic(), self.in_flight
        self._task = asyncio.get_running_loop().create_task(self._run(grace_s))
        return True

    async def drain(self, grace_s: float) -> dict[str, Any]:
        """Refuse new requests, let those in flight finish for up to ``grace_s``, then cut the rest.

        Joins a drain already under way (its grace period holds).

        Returns
        -------
        dict
            ``{"in_flight": requests when the drain began, "cut": requests still running at the
            end of the grace period, "left": requests not finished even after the cut, "grace_s":
            the grace period the drain had}``.
        """
        self.begin_drain(grace_s)
        return dict(await asyncio.shield(self._task))

    def state(self) -> dict[str, Any]:
        """What ``/admin/drain`` reports: whether a drain runs, its grace period, what is still in flight."""
        if self._task is None:
            return {"draining": False, "in_flight": self.in_flight}
        done = self._task.done()
        out = {"draining": True, "grace_s": self._grace_s,
               "elapsed_s": round(time.monotonic() - self._started_at, 3),
               "in_flight_at_start": self._started_in_flight, "in_flight": self.in_flight,
               "cut_started": self.cut.is_set(), "done": done}
        if done and not self._task.cancelled() and self._task.exception() is None:
            out["result"] = self._task.result()
        return out

    async def until_cut(self, events: AsyncIterator, retry_after_s: float) -> AsyncIterator:
        """``events``, ended by a 503 :class:`OpenAIError` when a shutdown's grace period runs out."""
        cut = self.cut
        if cut.is_set():
            raise shutting_down_error(retry_after_s)
        it = events.__aiter__()
        waiter = asyncio.ensure_future(cut.wait())
        nxt: asyncio.Future | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                await asyncio.wait((nxt, waiter), return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    raise OpenAIError(503, "The server shut down before this request finished (the shutdown grace "
                                      "period ran out); retry on another instance.", "service_unavailable", None,
                                      "server_shutting_down")
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            waiter.cancel()
            abandon(nxt)  # cut, or our consumer was cancelled (client gone)


def shutting_down_error(retry_after_s: float) -> OpenAIError:
    """The 503 of a request refused because the server is shutting down."""
    return OpenAIError(503, "The server is shutting down and accepts no new requests; retry on another instance.",
                       "service_unavailable", None, "server_shutting_down",
                       {"Retry-After": str(max(1, round(retry_after_s)))})
