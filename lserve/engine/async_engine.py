"""AsyncEngine: the engine loop in a background thread, tokens streamed per request.

One thread owns the :class:`LLMEngine` (no locks around its state): requests and aborts reach
it through a command queue and are applied between steps, and each step's outputs are handed
back to the asyncio loop of the request that asked. Cancelling a consumer (a client that
disconnects) aborts its request, which frees its pages before the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator

from lserve.config import EngineConfig
from lserve.engine.llm_engine import EngineStats, LLMEngine
from lserve.engine.request_check import RequestError
from lserve.engine.sampling import SamplingParams
from lserve.engine.sequence import RequestOutput
from lserve.models.loader import LoadedModel

log = logging.getLogger("lserve")


def _put_all(puts: list) -> None:
    for q, item in puts:
        q.put_nowait(item)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; the replica must be restarted."""


class AsyncEngine:
    """Thread-backed async front of :class:`LLMEngine`.

    Parameters
    ----------
    config : EngineConfig
    loaded : LoadedModel, optional
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 engine: LLMEngine | None = None) -> None:
        self.engine = engine or LLMEngine(config, loaded)
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self.error: BaseException | None = None
        self.aborted = 0
        self._warm = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lserve-engine", daemon=True)
        self._thread.start()
        self._warm.wait()  # the loop's warm-up is done before the first request is taken
        if self.error is not None:
            raise self.error

    # -- health -------------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the loop has died."""
        if not self.is_alive:
            raise EngineDeadError(f"engine loop is dead: {self.error!r}")

    def kill(self) -> None:
        """Stop the loop as a crash would (for failure drills)."""
        self.error = RuntimeError("engine loop killed")
        self._stop.set()
        self._wake.set()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def describe(self) -> dict:
        """:meth:`LLMEngine.describe` of the engine behind the loop."""
        return self.engine.describe()

    def encode(self, prompt, chat: bool = False) -> list[int]:
        """Token ids of a prompt (text, ids or chat messages); safe to call from any thread."""
        return self.engine.encode_prompt(prompt, chat)

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt, params: SamplingParams, chat: bool = False) -> list[int]:
        """Tokenize and check a request now (raises :class:`RequestError`); returns prompt ids."""
        ids = self.engine.encode_prompt(prompt, chat)
        self.engine.check_request(ids, params)
        return ids

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       chat: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream :class:`RequestOutput` snapshots of one request until it finishes.

        Raises :class:`RequestError` before the first item for unservable input and
        :class:`EngineDeadError` if the loop dies. Closing the iterator aborts the request.
        """
        self.check_health()
        params = params or SamplingParams()
        ids = self.validate(prompt, params, chat)
        rid = request_id or f"areq-{next(self._ids)}"
        if rid in self._streams:
            raise RequestError(f"request id {rid!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        self._commands.put(("add", rid, ids, params, time.monotonic()))
        self._wake.set()
        finished = False
        try:
            failure = None  # an error that queued behind snapshots: raised after they went out
            while True:
                item, failure = (failure, None) if failure is not None else (await q.get(), None)
                # Snapshots that queued up while the consumer was busy go out as one: under many
                # streams a per-token hop through Ray and HTTP costs more than the decode step.
                while not isinstance(item, BaseException) and not item.finished and not q.empty():
                    nxt = q.get_nowait()
                    if isinstance(nxt, BaseException):
                        failure = nxt
                        break
                    item = item.then(nxt)
                if isinstance(item, BaseException):
                    # no local but `error` may hold it, and that one goes before it leaves: its
                    # traceback holds this frame (and self), so a local holding it would close a
                    # cycle that keeps the engine alive until the cyclic GC runs
                    error, item, nxt = item, None, None
                    try:
                        raise error
                    finally:
                        del error
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Ask the loop to abort a request (applied before the next step)."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    # -- the loop -----------------------------------------------------------------------------
    def _deliver(self, rid: str, item) -> None:
        self._deliver_all([(rid, item)])

    def _deliver_all(self, items: list) -> None:
        """Hand ``(request id, item)`` pairs to their consumers, in order: one wake-up per event
        loop for all of them (a step's outputs), not one per request, which costs the engine
        thread a self-pipe write and the loop a callback each."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, item in items:
            target = self._streams.get(rid)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, ids, params, arrival = cmd
                if rid not in self._streams:
                    continue  # the consumer went away before we saw it
                try:
                    self.engine.add_request(ids, params, request_id=rid, arrival=arrival)
                except RequestError as e:
                    self._deliver(rid, e)
            elif cmd[0] == "abort":
                if self.engine.abort(cmd[1]):
                    self.aborted += 1

    def _loop(self) -> None:
        try:
            # Before the first request, in this thread: cuDNN's plans live in a per-thread cache
            # (PyTorch's), so plans built in another thread would be built again by the first
            # long prompt (5-6 s of a fresh server's first 128k prompt on an H100).
            self.engine.warm_up()
            self._warm.set()
            while not self._stop.is_set():
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._deliver_all([(out.request_id, out) for out in self.engine.step()])
        except BaseException as e:  # noqa: BLE001 - any crash must reach every waiting request
            log.error("engine loop crashed: %s", traceback.format_exc())
            self.error = e
            self._warm.set()  # a failed warm-up reaches the constructor
        if self.error is not None:
            dead = EngineDeadError(f"engine loop is dead: {self.error!r}")
            for rid in list(self._streams):
                self._deliver(rid, dead)
