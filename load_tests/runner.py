"""Arrival schedules and the run loop.

Three ways to offer load:

* ``poisson``: open loop, requests arrive as a Poisson process of a given rate (exponential gaps,
  seeded), optionally capped by a maximum number in flight;
* ``concurrency``: closed loop, a fixed number of clients each sending its next request as soon
  as the previous one finished;
* ``burst``: every request at once.

A run is bounded twice: by the number of requests and by ``time_limit_s``, after which no new
request is sent and the ones in flight are cancelled (recorded as failed). ``send_for_s`` ends
sending earlier (once ``min_requests`` were sent) and lets the requests in flight finish. A request with
``after`` set (a chat's next turn) is sent when that request has finished, plus its think time
(in the closed loop, by the client that picks it up in dataset order).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from load_tests.client import RequestOptions, RequestResult, send_request
from load_tests.datasets import RequestSpec

MODES = ("poisson", "concurrency", "burst")


@dataclass
class LoadShape:
    """How requests are offered.

    Parameters
    ----------
    mode : str
        ``poisson``, ``concurrency`` or ``burst``.
    rate : float
        Requests per second (``poisson``).
    concurrency : int
        Clients (``concurrency``), or the cap on requests in flight (``poisson``; 0 = none).
    seed : int
        Seed of the arrival times.
    """

    mode: str
    rate: float = 1.0
    concurrency: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "poisson" and not self.rate > 0:
            raise ValueError(f"a Poisson rate must be > 0 requests/s, got {self.rate}")
        if self.mode == "concurrency" and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.concurrency < 0:
            raise ValueError("concurrency must be >= 0")

    def arrival_times(self, n: int) -> list[float]:
        """Send times (seconds from the start) of ``n`` open-loop requests.

        Parameters
        ----------
        n : int

        Returns
        -------
        list of float
            Non-decreasing; all zero for a burst.
        """
        if self.mode == "burst":
            return [0.0] * n
        if self.mode != "poisson":
            raise ValueError("closed-loop (concurrency) runs have no arrival times")
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(self.rate)
        return out


async def run_load(specs: list[RequestSpec], opts: RequestOptions, shape: LoadShape, time_limit_s: float,
                   progress: bool = True, send_for_s: float | None = None,
                   min_requests: int = 0) -> tuple[list[RequestResult], float, int]:
    """Send ``specs`` as ``shape`` says, within ``time_limit_s``.

    Parameters
    ----------
    specs : list of RequestSpec
    opts : RequestOptions
    shape : LoadShape
    time_limit_s : float
        Wall-clock cap of the whole run.
    progress : bool
        Show a tqdm progress bar (on stderr).
    send_for_s : float, optional
        Send no new request after this many seconds once ``min_requests`` were sent; the ones in
        flight run on (to ``time_limit_s``). None: send until the specs or the time limit run out.
    min_requests : int
        Requests sent whatever ``send_for_s`` says (within the time limit).

    Returns
    -------
    results : list of RequestResult
        One per request that was sent, in dataset order.
    duration : float
        Seconds from the first send to the last completion.
    not_sent : int
        Requests never sent because the time limit came first.
    """
    import aiohttp
    from tqdm.auto import tqdm

    if time_limit_s <= 0:
        raise ValueError("the time limit must be > 0 s")
    results: dict[int, RequestResult] = {}
    done = [asyncio.Event() for _ in specs]
    bar = tqdm(total=len(specs), desc=f"{shape.mode} load", unit="req", disable=not progress, dynamic_ncols=True)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s

    def may_send(at: float) -> bool:
        """Whether a request may still be sent at ``at`` (perf_counter seconds)."""
        if at >= deadline:
            return False
        return send_for_s is None or len(results) < min_requests or at < t0 + send_for_s

    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int) -> None:
            # A placeholder first: a request cancelled at the time limit still counts as sent.
            results[i] = RequestResult(index=i, start=time.perf_counter() - t0, input_len=specs[i].input_len,
                                       answer_ok=None if specs[i].answer is None else False)
            try:
                results[i] = await send_request(session, opts, specs[i], i, t0)
            finally:
                done[i].set()  # a later chat turn waits for this one
            bar.update(1)
            if not results[i].success:
                bar.set_postfix_str(f"failed: {sum(not r.success for r in results.values())}")

        tasks: list[asyncio.Task] = []
        if shape.mode == "concurrency":
            queue = list(range(len(specs)))[::-1]

            async def client() -> None:
                while queue and may_send(time.perf_counter()):
                    i = queue.pop()
                    if specs[i].after is not None:  # popped in order: the previous turn is sent or done
                        await done[specs[i].after].wait()
                        await asyncio.sleep(specs[i].think_s)
                    await one(i)

            tasks = [asyncio.create_task(client()) for _ in range(min(shape.concurrency, len(specs)))]
        else:
            cap = asyncio.Semaphore(shape.concurrency) if shape.concurrency else None

            async def capped(i: int) -> None:
                if cap is None:
                    await one(i)
                    return
                async with cap:
                    if may_send(time.perf_counter()):
                        await one(i)

            async def dependent(i: int) -> None:
                await done[specs[i].after].wait()
                await asyncio.sleep(specs[i].think_s)
                if may_send(time.perf_counter()) and results.get(specs[i].after, None) is not None:
                    await capped(i)

            free = [i for i, s in enumerate(specs) if s.after is None]
            tasks += [asyncio.create_task(dependent(i)) for i, s in enumerate(specs) if s.after is not None]
            for i, at in zip(free, shape.arrival_times(len(free))):
                delay = t0 + at - time.perf_counter()
                if not may_send(t0 + at):
                    break
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(capped(i)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
    bar.close()
    end = time.perf_counter() - t0
    for r in results.values():
        if not r.success and not r.error:
            r.error = "cancelled at the time limit"
    sent = [results[i] for i in sorted(results)]
    first = min((r.start for r in sent), default=0.0)
    last = max((r.start + r.e2e if r.e2e else end for r in sent), default=end)
    return sent, max(last - first, 1e-9), len(specs) - len(sent)
