"""The OpenAI-compatible HTTP front (FastAPI), independent of how it is deployed.

:class:`OpenAIServer` turns OpenAI requests into engine requests, sends them to the engine
deployment through a Ray Serve handle (routed by :mod:`lserve.serve.ray_router`), and turns the
engine's event stream back into OpenAI responses or SSE chunks. :func:`build_openai_app` wraps it
in a FastAPI app whose every error is OpenAI's JSON shape. The first event of every engine stream is
read before the HTTP response starts, so overload (429/503 + ``Retry-After``) and bad input (400)
are answered with a proper status instead of a broken 200 stream. :class:`GuardMiddleware`, the
outermost layer, checks the API key before anything reads the body, refuses requests while a
shutdown drains (:class:`Lifecycle`) and counts every response once (499 for a client that left).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lserve.serve.logprobs import chat_logprobs, completion_logprobs
from lserve.serve.metrics import get_http_metrics, render_metrics
from lserve.serve.prefix_keys import PrefixKeys
from lserve.serve.protocol import (
    MAX_CHOICES,
    MAX_STOP,
    MAX_STOP_CHARS,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    DrainRequest,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    OpenAIError,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
    bad_request,
)
from lserve.serve.ray_router import ROUTE_KWARG
from lserve.serve.router import routers_for
from lserve.serve.settings import API_KEY_ENV, ServeSettings

log = logging.getLogger("lserve.serve")

REPLICA_HEADER = "x-lserve-replica"
_FINISH = {"stop": "stop", "length": "length"}
GREEDY_BELOW = 1e-5
MIN_TOP_P = 1e-6
NEUTRAL_RESPONSE_FORMAT = {"type": "text"}
#: What :meth:`OpenAIServer.keepalives` puts between events after a silent interval, and the SSE
#: comment line sent for it (clients ignore comment lines).
KEEPALIVE = object()
SSE_KEEPALIVE = ": keep-alive\n\n"


def check_unicode(texts, param: str) -> None:
    """400 for text holding a lone UTF-16 surrogate (JSON ``"\\ud800"``): no tokenizer can encode it."""
    for s in texts:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad_request(f"{param} contains an unpaired UTF-16 surrogate (U+{ord(s[e.start]):04X} at character "
                              f"{e.start}), which is not valid Unicode text", param) from None


# -- the engine-facing side -------------------------------------------------------------------
class Admission:
    """Admission control: engine requests in flight through this ingress, against the capacity.

    Capacity is what the engine replicas hold (``replicas * max_ongoing_requests``) plus the
    queue allowance (``max_queued_requests``); requests beyond it are refused at once. Admitted
    requests that find every replica busy wait in the router's queue. Counting admitted requests
    (instead of Ray's count of requests not yet assigned, which a simultaneous burst fills even
    when replicas have room) makes "queue full" mean what it says.

    Parameters
    ----------
    per_replica, queue : int
    replicas : callable
        Returns the current number of engine replicas (changes with autoscaling and failures).
    """

    def __init__(self, per_replica: int, queue: int, replicas) -> None:
        self.per_replica, self.queue, self.replicas = per_replica, queue, replicas
        self.in_flight = 0

    @property
    def capacity(self) -> int:
        if self.queue < 0:
            return 1 << 62
        return max(1, self.replicas()) * self.per_replica + self.queue

    def acquire(self) -> bool:
        if self.in_flight >= self.capacity:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)


class SubRequest:
    """One engine request (one choice) of an HTTP request, with its open event stream.

    ``cancel()`` (idempotent) stops the engine stream and gives the admission slot back.
    """

    def __init__(self, index: int, stream, first: dict[str, Any], admission: Admission) -> None:
        self.index, self.stream, self.first = index, stream, first
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.prompt_tokens = int(first.get("prompt_tokens", 0))
        self.cached_tokens = 0  # of the prompt's, reused from the replica's prefix cache
        self.completion_tokens = 0
        self.logprobs: list = []  # lserve.serve.logprobs entries of the text so far (echoed prompt first)
        self.new_logprobs: list = []  # those of the last event
        self.text_offset = 0  # completions' text_offset of the next streamed token
        self.echoed = False
        self._admission: Admission | None = admission

    def cancel(self) -> None:
        try:
            self.stream.cancel()
        except Exception:  # noqa: BLE001 - already finished or gone
            pass
        if self._admission is not None:
            self._admission.release()
            self._admission = None

    def __del__(self) -> None:  # safety net: a response that was never iterated still frees its slot
        if self._admission is not None:
            self._admission.release()
            self._admission = None


class Lifecycle:
    """Drain state of one ingress replica: requests in flight, refusal of new ones, the cut.

    A drain (started by the shutdown path through :meth:`drain`, or by ``POST /admin/drain``
    through :meth:`begin_drain`; whichever comes first sets the grace period, and there is only
    ever one) makes :class:`GuardMiddleware` refuse new requests with 503, waits for the
    requests in flight to finish up to the grace period, then sets ``cut``: streams still
    running end with an SSE error event and ``data: [DONE]`` (:meth:`OpenAIServer.until_cut`),
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


def shutting_down_error(retry_after_s: float) -> OpenAIError:
    """The 503 of a request refused because the server is shutting down."""
    return OpenAIError(503, "The server is shutting down and accepts no new requests; retry on another instance.",
                       "service_unavailable", None, "server_shutting_down",
                       {"Retry-After": str(max(1, round(retry_after_s)))})


class OpenAIServer:
    """Request handling behind the OpenAI endpoints.

    Parameters
    ----------
    settings : ServeSettings
    engine : ray.serve.handle.DeploymentHandle
        Handle of the engine deployment (:class:`lserve.serve.replica.EngineReplica`).
    replica : str
        This ingress replica's id (a metrics label).
    """

    def __init__(self, settings: ServeSettings, engine, replica: str = "ingress") -> None:
        self.settings = settings
        self.engine = engine
        self.engine_stream = engine.options(stream=True)
        self.model_name = settings.model_name
        self.api_key = os.environ.get(API_KEY_ENV) or None
        self.http_metrics = get_http_metrics(self.model_name, replica)
        self.created = int(time.time())
        self._max_model_len = settings.max_model_len or None
        self._sparsity: dict | None = None
        self.admission = Admission(settings.replica_max_ongoing, settings.max_queued_requests, self.num_replicas)
        self.lifecycle = Lifecycle()
        self.prefix_keys = PrefixKeys(settings)

    def num_replicas(self) -> int:
        """Engine replicas the router currently knows (the configured count before the first request)."""
        counts = [len(r.curr_replicas) for r in routers_for(self.settings.app_name)]
        return max(counts) if counts else self.settings.replicas

    # -- checks -------------------------------------------------------------------------------
    def auth_error(self, auth: str) -> OpenAIError | None:
        """The 401 for an ``Authorization`` header value without the configured API key (None if it has it)."""
        if self.api_key is None:
            return None
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return None
        msg = "Incorrect API key provided." if auth else "Missing API key: send 'Authorization: Bearer <key>'."
        return OpenAIError(401, msg, "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})

    def authorize(self, request: Request) -> None:
        """401 unless the request carries the configured API key (``Authorization: Bearer``).

        :class:`GuardMiddleware` already checks every protected path before the body is read;
        this is for callers of the endpoint methods outside that app.
        """
        err = self.auth_error(request.headers.get("authorization", ""))
        if err is not None:
            raise err

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is the served model (or left out)."""
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                              "invalid_request_error", "model", "model_not_found")

    def sampling(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> dict[str, Any]:
        """Engine sampling fields from an OpenAI request (400 for unsupported or out-of-range values)."""
        refuse_unsupported(req)
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP:
            raise bad_request(f"at most {MAX_STOP} stop strings are allowed, got {len(stop)}", "stop")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stop):
            raise bad_request(f"stop strings must have 1 to {MAX_STOP_CHARS} characters", "stop")
        check_unicode(stop, "stop")
        token_budget = None
        extra: dict[str, Any] = {}
        if req.lserve is not None:
            if req.lserve.streaming is False:
                raise bad_request("lserve.streaming=false is not supported on this deployment: streaming heads are "
                                  "fixed when the engine starts and cannot be switched off per request",
                                  "lserve.streaming")
            token_budget = req.lserve.token_budget
            if req.lserve.prefix_cache is False:
                extra["prefix_cache"] = False
            if req.lserve.prefill_sparsity is not None:
                extra["prefill_sparsity"] = req.lserve.prefill_sparsity
            if token_budget is not None:
                page = self.settings.page_size
                if 0 < token_budget < 2 * page:
                    raise bad_request(f"lserve.token_budget must be 0 (selection off) or at least two KV pages "
                                      f"({2 * page} tokens), got {token_budget}", "lserve.token_budget")
                if self._max_model_len and token_budget > self._max_model_len:
                    raise bad_request(f"lserve.token_budget ({token_budget}) exceeds the model's context length "
                                      f"({self._max_model_len})", "lserve.token_budget")
        temperature = 1.0 if req.temperature is None else req.temperature
        if temperature < GREEDY_BELOW:  # dividing logits by ~0 overflows: treat as greedy (like vLLM)
            temperature = 0.0
        # A top_p that rounds to 0 in float32 would drop every token: it means "the top token only".
        top_p = 1.0 if req.top_p is None else max(req.top_p, MIN_TOP_P)
        return {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": req.top_k or 0,
                "seed": req.seed, "stop": stop, "ignore_eos": req.ignore_eos, "token_budget": token_budget,
                **logit_fields(req, max_tokens), **logprob_fields(req), **extra}

    # -- engine calls -------------------------------------------------------------------------
    async def _open(self, index: int, payload: dict[str, Any]) -> SubRequest:
        """Send one engine request and read its first event (raises :class:`OpenAIError`)."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        retry = {"Retry-After": str(max(1, round(self.settings.retry_after_s)))}
        if not self.admission.acquire():
            raise OpenAIError(self.settings.overload_status_code,
                              f"The server is at capacity ({self.admission.in_flight} requests in flight, capacity "
                              f"{self.admission.capacity}); retry later.", "server_overloaded", None,
                              "server_overloaded", retry)
        # tokenizing a long prompt takes milliseconds: off the event loop
        route = await asyncio.to_thread(self.prefix_keys.route, payload["prompt"], bool(payload.get("chat")))
        stream = self.engine_stream.generate.remote(payload, **{ROUTE_KWARG: route})
        try:
            try:
                first = await stream.__anext__()
            except BackPressureError as e:
                raise OpenAIError(self.settings.overload_status_code, f"The server is at capacity ({e}); retry later.",
                                  "server_overloaded", None, "server_overloaded", retry) from None
            except DeploymentUnavailableError:
                raise OpenAIError(503, "The engine deployment is unavailable; retry later.", "service_unavailable",
                                  None, "service_unavailable", retry) from None
            except RayActorError:
                raise OpenAIError(503, "The engine replica died while accepting the request; retry.",
                                  "service_unavailable", None, "service_unavailable", retry) from None
            except StopAsyncIteration:
                raise OpenAIError(503, "The engine closed the request without an answer; retry.",
                                  "service_unavailable", None, "service_unavailable", retry) from None
            if first.get("type") == "error":
                status = int(first.get("status", 500))
                headers = retry if status in (429, 503) else None
                etype = "invalid_request_error" if status == 400 else "service_unavailable"
                raise OpenAIError(status, first.get("message", "engine error"), etype, first.get("param"),
                                  first.get("code"), headers)
        except BaseException:  # including the client going away while we waited
            stream.cancel()
            self.admission.release()
            raise
        return SubRequest(index, stream, first, self.admission)

    async def open_all(self, payloads: list[dict[str, Any]]) -> list[SubRequest]:
        """Open every choice's engine stream; on any failure, cancel the opened ones and raise.

        The streams are opened one after the other: Ray Serve gives every handle call made while
        serving one HTTP request the same internal request id, and a router that matches replicas
        to requests by that id (as ours does, to honour per-request decisions) must not see two of
        them pending at once.
        """
        subs: list[SubRequest] = []
        try:
            for i, p in enumerate(payloads):
                subs.append(await self._open(i, p))
        except BaseException:
            for s in subs:
                s.cancel()
            raise
        return subs

    @staticmethod
    async def events(subs: list[SubRequest]) -> AsyncIterator[tuple[SubRequest, dict[str, Any]]]:
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

    async def until_cut(self, events: AsyncIterator) -> AsyncIterator:
        """``events``, ended by a 503 :class:`OpenAIError` when a shutdown's grace period runs out."""
        cut = self.lifecycle.cut
        if cut.is_set():
            raise shutting_down_error(self.settings.retry_after_s)
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
            if nxt is not None and not nxt.done():  # cut, or our consumer was cancelled (client gone)
                nxt.cancel()
                nxt.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody reads it now

    @staticmethod
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
            if nxt is not None and not nxt.done():  # our consumer was cancelled (client gone)
                nxt.cancel()
                nxt.add_done_callback(lambda t: t.cancelled() or t.exception())

    @staticmethod
    def stream_error(e: BaseException) -> dict[str, Any]:
        """The in-band SSE error event for a stream that fails after its 200 was sent."""
        if isinstance(e, OpenAIError):
            return e.body()
        return {"error": {"message": "the engine failed while generating; retry", "type": "service_unavailable",
                          "param": None, "code": "service_unavailable"}}

    # -- endpoints ----------------------------------------------------------------------------
    def _payloads(self, prompts: list, chat: bool, params: dict[str, Any], n: int, rid: str) -> list[dict[str, Any]]:
        if len(prompts) * n > MAX_CHOICES:
            raise bad_request(f"n times the number of prompts must be at most {MAX_CHOICES}, got {len(prompts) * n}", "n")
        out = []
        for prompt in prompts:
            for j in range(n):
                p = dict(params)
                if p["seed"] is not None and j:
                    p["seed"] = (p["seed"] + j) % (2**63)
                out.append({"request_id": f"{rid}-{len(out)}", "prompt": prompt, "chat": chat, "params": p})
        return out

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        """``POST /v1/completions``: JSON, or SSE chunks when ``stream`` is set."""
        self.authorize(request)
        self.check_model(req.model)
        await self.max_model_len()  # known once, for the token_budget bound
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise bad_request("the prompt is empty", "prompt")
        check_unicode([p for p in prompts if isinstance(p, str)], "prompt")
        params = self.sampling(req, req.max_tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        subs = await self.open_all(self._payloads(prompts, False, params, req.n, rid))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._sse(subs, rid, "text_completion", include_usage, n=req.n, logprobs=req.logprobs is not None)
        await self._collect(subs)
        choices = [CompletionChoice(index=s.index, text="".join(s.text), finish_reason=_FINISH.get(s.finish_reason),
                                    logprobs=None if req.logprobs is None else
                                    CompletionLogprobs(**completion_logprobs(s.logprobs, 0)[0]))
                   for s in subs]
        body = CompletionResponse(id=rid, model=self.model_name, choices=choices, usage=self._usage(subs, req.n))
        return JSONResponse(body.model_dump(), headers={REPLICA_HEADER: subs[0].first.get("replica", "")})

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        """``POST /v1/chat/completions`` (the model's chat template): JSON, or SSE chunks when ``stream`` is set."""
        self.authorize(request)
        self.check_model(req.model)
        await self.max_model_len()
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
            check_unicode([content], f"messages.{i}.content")
            messages.append({"role": m.role, "content": content})
        params = self.sampling(req, req.max_completion_tokens or req.max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        subs = await self.open_all(self._payloads([messages], True, params, req.n, rid))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._sse(subs, rid, "chat.completion.chunk", include_usage, n=req.n, logprobs=bool(req.logprobs))
        await self._collect(subs)
        choices = [ChatChoice(index=s.index, message=AssistantMessage(content="".join(s.text)),
                              logprobs=ChatLogprobs(**chat_logprobs(s.logprobs)) if req.logprobs else None,
                              finish_reason=_FINISH.get(s.finish_reason)) for s in subs]
        body = ChatCompletionResponse(id=rid, model=self.model_name, choices=choices, usage=self._usage(subs, req.n))
        return JSONResponse(body.model_dump(), headers={REPLICA_HEADER: subs[0].first.get("replica", "")})

    async def _collect(self, subs: list[SubRequest]) -> None:
        try:
            async for sub, ev in self.until_cut(self.events(subs)):
                self._apply(sub, ev)
        except OpenAIError:
            raise
        except Exception as e:  # noqa: BLE001 - a replica died mid-request
            log.warning("engine stream failed: %r", e)
            raise OpenAIError(503, "the engine failed while generating; retry", "service_unavailable", None,
                              "service_unavailable", {"Retry-After": str(max(1, round(self.settings.retry_after_s)))}) from None
        finally:
            for s in subs:
                s.cancel()

    @staticmethod
    def _apply(sub: SubRequest, ev: dict[str, Any]) -> str:
        """Fold one event into its choice; returns the new text."""
        if ev.get("type") == "error":
            raise OpenAIError(int(ev.get("status", 503)), ev.get("message", "engine error"), "service_unavailable",
                              None, ev.get("code"))
        if ev.get("type") != "delta":
            return ""
        text = ev["text"]
        sub.new_logprobs = list(ev.get("prompt_logprobs") or []) + list(ev.get("logprobs") or [])
        if "prompt_text" in sub.first and not sub.echoed:  # echo: the prompt leads the choice's text
            sub.echoed = True
            text = sub.first["prompt_text"] + text
        sub.logprobs += sub.new_logprobs
        sub.text.append(text)
        sub.completion_tokens = int(ev.get("completion_tokens", sub.completion_tokens))
        sub.prompt_tokens = int(ev.get("prompt_tokens", sub.prompt_tokens))
        sub.cached_tokens = int(ev.get("cached_tokens", sub.cached_tokens))
        if ev.get("finished"):
            sub.finish_reason = ev.get("finish_reason")
        return text

    @staticmethod
    def _usage(subs: list[SubRequest], n: int) -> Usage:
        prompt = sum(s.prompt_tokens for s in subs if s.index % n == 0)  # each prompt counted once
        cached = sum(s.cached_tokens for s in subs if s.index % n == 0)
        completion = sum(s.completion_tokens for s in subs)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def _sse(self, subs: list[SubRequest], rid: str, obj: str, include_usage: bool, n: int,
             logprobs: bool = False) -> StreamingResponse:
        created = int(time.time())
        chat = obj == "chat.completion.chunk"

        def chunk(choices: list[dict], usage: dict | None = None, with_usage: bool = include_usage) -> str:
            body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                                    "choices": choices}
            if with_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def choice_logprobs(sub: SubRequest) -> dict | None:
            if not logprobs:
                return None
            if chat:
                return chat_logprobs(sub.new_logprobs)
            out, sub.text_offset = completion_logprobs(sub.new_logprobs, sub.text_offset)
            return out

        def choice(sub: SubRequest, text: str | None, finish: str | None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": sub.index, "delta": delta, "logprobs": choice_logprobs(sub), "finish_reason": finish}
            return {"index": sub.index, "text": text or "", "logprobs": choice_logprobs(sub), "finish_reason": finish}

        async def body() -> AsyncIterator[str]:
            try:
                if chat:
                    for s in subs:
                        yield chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                try:
                    async for item in self.keepalives(self.until_cut(self.events(subs)), self.settings.sse_keepalive_s):
                        if item is KEEPALIVE:
                            yield SSE_KEEPALIVE
                            continue
                        sub, ev = item
                        text = self._apply(sub, ev)
                        finish = _FINISH.get(sub.finish_reason) if ev.get("finished") else None
                        if text or finish or (logprobs and sub.new_logprobs):
                            yield chunk([choice(sub, text if text else None, finish)])
                except Exception as e:  # noqa: BLE001 - reported in-band: the 200 has been sent
                    log.warning("stream %s failed: %r", rid, e)
                    yield f"data: {json.dumps(self.stream_error(e))}\n\n"
                else:
                    if include_usage:
                        yield chunk([], self._usage(subs, n).model_dump())
                yield "data: [DONE]\n\n"
            finally:  # also on client disconnect: cancelling the engine streams aborts the requests
                for s in subs:
                    s.cancel()

        headers = {REPLICA_HEADER: subs[0].first.get("replica", ""), "Cache-Control": "no-cache"}
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

    async def _engine_call(self, method: str, arg) -> dict[str, Any]:
        """One short call to some engine replica (tokenizer work); 503 when none answers."""
        try:
            out = await asyncio.wait_for(getattr(self.engine, method).remote(arg), timeout=30)
        except Exception:  # noqa: BLE001 - no replica, or it died
            raise OpenAIError(503, "no engine replica answered; retry later", "service_unavailable", None,
                              "service_unavailable",
                              {"Retry-After": str(max(1, round(self.settings.retry_after_s)))}) from None
        if "error" in out:
            raise bad_request(out["error"], "messages" if method == "tokenize" and isinstance(arg, dict)
                              and "messages" in arg else ("tokens" if method == "detokenize" else "prompt"))
        return out

    async def tokenize(self, req: TokenizeRequest, request: Request) -> TokenizeResponse:
        """``POST /tokenize`` (vLLM's): the engine's token ids of a prompt or a chat."""
        self.authorize(request)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give either prompt or messages", "prompt")
        if req.messages is not None:
            if req.add_special_tokens:
                raise bad_request("add_special_tokens is not supported with messages (the chat template adds "
                                  "its own)", "add_special_tokens")
            if not req.add_generation_prompt:
                raise bad_request("add_generation_prompt false is not supported", "add_generation_prompt")
            messages = []
            for i, m in enumerate(req.messages):
                content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
                check_unicode([content], f"messages.{i}.content")
                messages.append({"role": m.role, "content": content})
            payload: dict[str, Any] = {"messages": messages}
        else:
            check_unicode([req.prompt], "prompt")
            payload = {"prompt": req.prompt, "add_special_tokens": req.add_special_tokens is not False}
        out = await self._engine_call("tokenize", payload)
        return TokenizeResponse(count=len(out["tokens"]), max_model_len=out["max_model_len"], tokens=out["tokens"])

    async def detokenize(self, req: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        """``POST /detokenize`` (vLLM's): the text of token ids, decoded as generated text is."""
        self.authorize(request)
        self.check_model(req.model)
        return DetokenizeResponse(prompt=(await self._engine_call("detokenize", req.tokens))["prompt"])

    async def max_model_len(self) -> int | None:
        """The engine's context length (configured, or asked of a replica once; None if none answers)."""
        if self._max_model_len is None:
            try:
                info = await asyncio.wait_for(self.engine.info.remote(), timeout=10)
                self._max_model_len = int(info["max_model_len"])
                self._sparsity = info.get("sparsity")
            except Exception:  # noqa: BLE001 - unknown until a replica answers
                return None
        return self._max_model_len

    async def sparsity(self) -> dict | None:
        """The sparsity the replicas run (:func:`lserve.sparsity.shipped.in_effect`), asked of a
        replica once; None until one answers."""
        if self._sparsity is None:
            try:
                info = await asyncio.wait_for(self.engine.info.remote(), timeout=10)
                self._sparsity = info.get("sparsity")
            except Exception:  # noqa: BLE001 - unknown until a replica answers
                return None
        return self._sparsity

    async def models(self, request: Request) -> ModelList:
        """``GET /v1/models``."""
        self.authorize(request)
        return ModelList(data=[await self.model_card()])

    async def model_card(self) -> ModelCard:
        """The served model's card."""
        return ModelCard(id=self.model_name, created=self.created, max_model_len=await self.max_model_len(),
                         sparsity=await self.sparsity())

    async def model(self, request: Request, model_id: str) -> ModelCard:
        """``GET /v1/models/{model_id}``: the card of the served model, 404 for any other id."""
        self.authorize(request)
        self.check_model(model_id)
        return await self.model_card()

    def reported_stats(self) -> list[dict[str, Any]] | None:
        """Every engine replica's last report to the router, if all are fresh (None otherwise).

        Replicas report outside their request slots, so this never waits behind busy replicas.
        """
        fresh_s = max(5.0, 4 * self.settings.routing_stats_period_s)
        now = time.time()
        for router in routers_for(self.settings.app_name):
            stats = [dict(r.routing_stats or {}) for r in router.curr_replicas.values()]
            if stats and all(now - float(st.get("ts", 0.0)) < fresh_s for st in stats):
                for st in stats:
                    st["age_s"] = round(now - float(st.pop("ts")), 3)
                return stats
        return None

    async def healthy_replicas(self) -> int:
        """Engine replicas whose engine loop is alive."""
        stats = await self.engine_stats(timeout_s=10.0)
        return sum(1 for s in stats if isinstance(s, dict) and s.get("alive"))

    async def engine_stats(self, timeout_s: float = 30.0) -> list[dict[str, Any] | str]:
        """Engine state of every replica (an error string for one that did not answer).

        From the replicas' reports to the router when there are fresh ones (before the first
        request there are none), else asked of every replica.
        """
        reported = self.reported_stats()
        if reported is not None:
            return reported
        results = await self.engine.broadcast("engine_stats").results_async(timeout_s=timeout_s,
                                                                             return_exceptions=True)
        return [r if isinstance(r, dict) else f"{type(r).__name__}: {r}" for r in results]


# -- request fields -> engine fields ----------------------------------------------------------
def refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for fields set to a value that would change the output in a way LServe does not implement."""
    fmt = req.response_format
    unsupported = [("response_format", fmt is not None and fmt != NEUTRAL_RESPONSE_FORMAT,
                    'structured output is not supported; use {"type": "text"} or leave it unset')]
    if isinstance(req, CompletionRequest):
        unsupported += [("best_of", (req.best_of or 1) != 1, "only 1 (or null) is supported"),
                        ("suffix", req.suffix is not None, "leave it unset")]
    else:
        no_tools = "tool and function calling are not supported; leave it unset"
        unsupported += [("tools", bool(req.tools), no_tools),
                        ("tool_choice", req.tool_choice not in (None, "none"), no_tools),
                        ("functions", bool(req.functions), no_tools),
                        ("function_call", req.function_call not in (None, "none"), no_tools)]
    for name, bad, why in unsupported:
        if bad:
            raise bad_request(f"'{name}' is not supported by this server: {why}", name)


def logit_fields(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> dict[str, Any]:
    """Penalties, ``logit_bias`` (token-id string keys) and ``min_tokens`` as engine fields."""
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.isdigit():
            raise bad_request(f"logit_bias keys must be token ids (non-negative integers as strings), got {key!r}",
                              "logit_bias")
        bias[int(key)] = value
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    return {"presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
            "logit_bias": bias or None, "min_tokens": req.min_tokens}


def logprob_fields(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """``logprobs`` / ``top_logprobs`` / ``echo`` as engine fields (``echo`` is read by the replica)."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return {"logprobs": (req.top_logprobs or 0) if req.logprobs else None}
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens 0 is only allowed with echo: true (to score the prompt)", "max_tokens")
    prompt_logprobs = None
    if req.echo:  # max_tokens 0 generates nothing: the engine then only runs the prompt (and scores it)
        prompt_logprobs = req.logprobs if req.logprobs is not None else (0 if req.max_tokens == 0 else None)
    return {"logprobs": req.logprobs, "prompt_logprobs": prompt_logprobs, "echo": req.echo}


# -- the HTTP app -----------------------------------------------------------------------------
class _BodyTooLarge(StarletteHTTPException):
    pass


class BodyLimitMiddleware:
    """413 for request bodies over ``max_bytes`` (declared or streamed)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        message = f"The request body exceeds the limit of {limit} bytes."
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                response = JSONResponse(OpenAIError(413, message, code="request_too_large").body(), status_code=413)
                await response(scope, receive, send)
                return
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge(413, message)
            return msg

        await self.app(scope, limited_receive, send)


#: Probes and scrapes: open without the API key, served while draining, not counted as traffic.
PROBE_PATHS = ("/health", "/metrics")
#: Starts (POST) or reports (GET) a drain: needs the API key, answered while draining, not a request
#: the drain waits for.
DRAIN_PATH = "/admin/drain"
#: Path prefixes that need the API key (when one is configured).
PROTECTED_PREFIXES = ("/v1", "/admin", "/tokenize", "/detokenize")
#: Status counted for a request whose client went away before its response was complete
#: (nginx's "client closed request"): not a server error.
CLIENT_CLOSED = 499


class _Exchange:
    """What one request's ASGI messages showed: the status sent, completion, a vanished client."""

    def __init__(self, receive, send) -> None:
        self._receive, self._send = receive, send
        self.status: int | None = None
        self.complete = False
        self.client_gone = False
        self.left_early = False
        self.failed = False

    async def receive(self):
        try:
            msg = await self._receive()
        except Exception as e:
            from ray.exceptions import TaskCancelledError

            # Ray's proxy cancels its side of the request when the client disconnects; reading
            # then fails instead of returning the disconnect message the ASGI spec promises.
            if not isinstance(e, TaskCancelledError):
                raise
            msg = {"type": "http.disconnect"}
        if msg["type"] == "http.disconnect":
            self.client_gone = True
            # gone before the answer began: whatever the app then sends (FastAPI turns a body cut
            # short into a 400) reaches no one
            self.left_early = self.status is None
        return msg

    async def send(self, msg) -> None:
        if msg["type"] == "http.response.start":
            self.status = int(msg["status"])
        elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
            self.complete = True
        await self._send(msg)

    def counted_status(self) -> int:
        if self.left_early:
            return CLIENT_CLOSED
        if self.complete and self.status is not None:
            return self.status
        if self.client_gone:
            return CLIENT_CLOSED
        return 500 if self.failed or self.status is None else self.status


class GuardMiddleware:
    """The outermost layer: the API key first, refusal while draining, one count per response.

    * Paths under :data:`PROTECTED_PREFIXES` need the API key, checked on the headers before
      anything reads the body: a request without the key gets 401 whatever its body holds.
    * While the server drains (:class:`Lifecycle`), every request but the probes and
      :data:`DRAIN_PATH` gets 503; those are not counted as requests in flight either.
    * A client that goes away is not a server error: the request ends quietly (no traceback)
      and is counted with status :data:`CLIENT_CLOSED`.
    * Every response except the probes' is counted once in ``lserve:http_responses_total``, by
      route and status, when it has been sent (a stream when it ends).

    Parameters
    ----------
    app
        The ASGI app inside.
    server : OpenAIServer
    routes : list
        The app's routes (to label a request refused before routing).
    """

    def __init__(self, app, server: OpenAIServer, routes: list) -> None:
        self.app, self.server, self.routes = app, server, routes

    def _endpoint(self, scope) -> str:
        route = scope.get("route")
        if route is None:
            from starlette.routing import Match

            route = next((r for r in self.routes if r.matches(scope)[0] == Match.FULL), None)
        return getattr(route, "path", "unmatched")

    def _refusal(self, scope) -> OpenAIError | None:
        path = scope["path"]
        if any(path == p or path.startswith(p + "/") for p in PROTECTED_PREFIXES):
            auth = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"authorization"), "")
            err = self.server.auth_error(auth)
            if err is not None:
                return err
        if self.server.lifecycle.draining and path != DRAIN_PATH:
            return shutting_down_error(self.server.settings.retry_after_s)
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        if scope.get("method") == "POST":  # every body here is JSON, whatever the client's content type says
            # (curl -d sends application/x-www-form-urlencoded)
            scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        err = self._refusal(scope)
        if err is not None:
            response = JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)
            await response(scope, receive, send)
            self.server.http_metrics.count(self._endpoint(scope), err.status)
            return
        ex = _Exchange(receive, send)
        lifecycle = self.server.lifecycle
        counted = scope["path"] != DRAIN_PATH
        lifecycle.in_flight += counted
        try:
            await self.app(scope, ex.receive, ex.send)
        except asyncio.CancelledError:  # Ray cancels the request when its client disconnects
            ex.client_gone = True
            raise
        except Exception:
            if not ex.client_gone:
                ex.failed = True
                raise  # the app's error handler answers 500 and logs it
            # the client is gone (e.g. it left while its body was being read): no one to answer
        finally:
            lifecycle.in_flight -= counted
            self.server.http_metrics.count(self._endpoint(scope), ex.counted_status())


_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}
# OpenAPI 3.1: a sequential media type's schema describes each event. Each `data` is one JSON chunk
# (chat.completion.chunk / text_completion, or an {"error": ...} object) and the last is "[DONE]".
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}
_STREAMING_200 = {"text/event-stream": {"schema": _SSE_EVENT}}


def build_openai_app(server: OpenAIServer) -> FastAPI:
    """The FastAPI app of the OpenAI endpoints, admin views, ``/health`` and ``/metrics``."""
    app = FastAPI(title="LServe", version="0.1.0", description="OpenAI-compatible API of LServe.")
    app.add_middleware(BodyLimitMiddleware, max_bytes=server.settings.max_body_bytes)
    # Added last, so outermost: the API key is checked before the body limit and the body.
    # Responses are counted there, labelled by route, not raw path (scanners must not explode cardinality).
    app.add_middleware(GuardMiddleware, server=server, routes=app.routes)

    def error_response(e: OpenAIError, request: Request) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return error_response(e, request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return error_response(bad_request("The request body is not valid JSON."), request)
        locs = [[str(x) for x in err.get("loc", ()) if x != "body"] for err in errs] or [[]]
        # A value matching none of a union's types gives one error per member, each with the member
        # as an extra location step: report the field they share.
        same_field = [loc for loc in locs if loc[:1] == locs[0][:1]]
        loc = locs[0]
        if len(same_field) > 1:
            n = 0
            while all(len(x) > n and x[n] == loc[n] for x in same_field):
                n += 1
            loc = loc[:n]
        param = ".".join(loc) or None
        msg = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        if len(same_field) > 1:
            msg = f"{param or 'body'}: the value matches none of the accepted types ({first.get('msg', '')})"
        others = len(errs) - len(same_field)
        if others:
            msg += f" (and {others} more problem{'s' if others > 1 else ''})"
        return error_response(bad_request(msg, param), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code)
        err = OpenAIError(e.status_code, str(e.detail), "invalid_request_error", None, kind, dict(e.headers or {}))
        return error_response(err, request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(OpenAIError(500, "Internal server error.", "server_error", None, "internal_error"),
                              request)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**_ERRORS, 200: {"content": _STREAMING_200}})
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await server.completions(req, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERRORS, 200: {"content": _STREAMING_200}})
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(req, request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(req: TokenizeRequest, request: Request) -> TokenizeResponse:
        return await server.tokenize(req, request)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        return await server.detokenize(req, request)

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def models(request: Request) -> ModelList:
        return await server.models(request)

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={401: _ERRORS[401], 404: _ERRORS[404]})
    async def model(model_id: str, request: Request) -> ModelCard:
        return await server.model(request, model_id)

    @app.get("/health", response_model=HealthResponse, responses={503: _ERRORS[503]})
    async def health() -> HealthResponse:
        if server.lifecycle.draining:  # load balancers stop sending here while in-flight requests finish
            raise shutting_down_error(server.settings.retry_after_s)
        alive = await server.healthy_replicas()
        if not alive:
            raise OpenAIError(503, "no healthy engine replica", "service_unavailable", None, "service_unavailable",
                              {"Retry-After": str(max(1, round(server.settings.retry_after_s)))})
        return HealthResponse(status="ok", replicas=alive)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        data, ctype = await asyncio.to_thread(render_metrics)
        return Response(content=data, media_type=ctype)

    @app.get("/admin/engines", responses={401: _ERRORS[401]})
    async def admin_engines(request: Request) -> dict:
        """Engine state of every replica: running/waiting requests, KV pages in use (needs the API key)."""
        server.authorize(request)
        reported = server.reported_stats()
        if reported is not None:
            return {"model": server.model_name, "source": "reports", "replicas": reported}
        return {"model": server.model_name, "source": "broadcast", "replicas": await server.engine_stats()}

    @app.post(DRAIN_PATH, status_code=202, responses={401: _ERRORS[401], 400: _ERRORS[400]})
    async def admin_drain(request: Request, req: DrainRequest | None = None) -> dict:
        """Start the shutdown drain of this server now (needs the API key; idempotent).

        ``/health`` and new requests get 503 at once, running requests get ``grace_s`` (default:
        ``shutdown_grace_s``) to finish, then streams still running end with an error event and
        ``[DONE]``. The drain cannot be undone: the server stays drained until it restarts. The
        app has one ingress replica (:func:`lserve.serve.app.build_app_from_settings`), so one
        call drains the whole application whichever proxy it goes through. A second call
        changes nothing and reports the drain under way (``started`` false).
        """
        server.authorize(request)
        grace = server.settings.shutdown_grace_s if req is None or req.grace_s is None else req.grace_s
        started = server.lifecycle.begin_drain(grace)
        return {"object": "drain", "started": started, **server.lifecycle.state()}

    @app.get(DRAIN_PATH, responses={401: _ERRORS[401]})
    async def admin_drain_state(request: Request) -> dict:
        """The drain's state: whether one runs, its grace period, requests still in flight (needs the API key)."""
        server.authorize(request)
        return {"object": "drain", **server.lifecycle.state()}

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)  # validation errors are 400 here
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app
