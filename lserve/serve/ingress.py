"""The OpenAI-compatible request handling of the ingress, independent of how it is deployed.

:class:`OpenAIServer` turns OpenAI requests into engine requests (:mod:`lserve.serve.params`),
sends them to the engine deployment through a Ray Serve handle (routed by
:mod:`lserve.serve.ray_router`), and turns the engine's event stream back into OpenAI responses or
SSE chunks (:mod:`lserve.serve.responses`). The first event of every engine stream is read before
the HTTP response starts, so overload (429/503 + ``Retry-After``) and bad input (400) are answered
with a proper status instead of a broken 200 stream. The FastAPI app around it is
:func:`lserve.serve.openai_app.build_openai_app`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from lserve.serve.admission import Admission, SubRequest
from lserve.serve.lifecycle import Lifecycle
from lserve.serve.metrics import get_http_metrics
from lserve.serve.middleware import auth_error
from lserve.serve.params import api_param, check_unicode, engine_fields, message_dicts
from lserve.serve.prefix_keys import PrefixKeys
from lserve.serve.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeRequest,
    TokenizeResponse,
    bad_request,
)
from lserve.serve.ray_router import ROUTE_KWARG
from lserve.serve.responses import chat_response, collect, completion_response, sse_response
from lserve.serve.router import routers_for
from lserve.serve.settings import API_KEY_ENV, ServeSettings
from lserve.serve.streams import merged_events

log = logging.getLogger("lserve.serve")


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
        # by value: each streamed item goes over the replica's gRPC server, not the object store
        self.engine = engine.options(_by_reference=not settings.engine_calls_by_value)
        self.engine_stream = self.engine.options(stream=True)
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
    def authorize(self, request: Request) -> None:
        """401 unless the request carries the configured API key (``Authorization: Bearer``).

        :class:`~lserve.serve.middleware.GuardMiddleware` already checks every protected path before the body is read;
        this is for callers of the endpoint methods outside that app.
        """
        err = auth_error(self.api_key, request.headers.get("authorization", ""))
        if err is not None:
            raise err

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is the served model (or left out)."""
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                              "invalid_request_error", "model", "model_not_found")

    # -- engine calls -------------------------------------------------------------------------
    async def _open(self, index: int, payload: dict[str, Any], req: CompletionRequest | ChatCompletionRequest
                    ) -> SubRequest:
        """Send one engine request and read its first event (raises :class:`OpenAIError`; an
        engine error names the field of ``req`` behind the engine field it names)."""
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
                raise OpenAIError(status, first.get("message", "engine error"), etype, api_param(req, first.get("param")),
                                  first.get("code"), headers)
        except BaseException:  # including the client going away while we waited
            stream.cancel()
            self.admission.release()
            raise
        return SubRequest(index, stream, first, self.admission)

    async def open_all(self, payloads: list[dict[str, Any]], req: CompletionRequest | ChatCompletionRequest
                       ) -> list[SubRequest]:
        """Open every choice's engine stream; on any failure, cancel the opened ones and raise.

        The streams are opened one after the other: Ray Serve gives every handle call made while
        serving one HTTP request the same internal request id, and a router that matches replicas
        to requests by that id (as ours does, to honour per-request decisions) must not see two of
        them pending at once.
        """
        subs: list[SubRequest] = []
        try:
            for i, p in enumerate(payloads):
                subs.append(await self._open(i, p, req))
        except BaseException:
            for s in subs:
                s.cancel()
            raise
        return subs

    # -- endpoints ----------------------------------------------------------------------------
    def _payloads(self, prompts: list, chat: bool, params: dict[str, Any], n: int, rid: str,
                  stream: bool) -> list[dict[str, Any]]:
        if len(prompts) * n > MAX_CHOICES:
            raise bad_request(f"n times the number of prompts must be at most {MAX_CHOICES}, got {len(prompts) * n}", "n")
        out = []
        for prompt in prompts:
            for j in range(n):
                p = dict(params)
                if p["seed"] is not None and j:
                    p["seed"] = (p["seed"] + j) % (2**63)
                out.append({"request_id": f"{rid}-{len(out)}", "prompt": prompt, "chat": chat, "params": p,
                            "stream": stream})
        return out

    def _events(self, subs: list[SubRequest]):
        """All choices' events, ended with a 503 when a shutdown drain cuts the request."""
        return self.lifecycle.until_cut(merged_events(subs), self.settings.retry_after_s)

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        """``POST /v1/completions``: JSON, or SSE chunks when ``stream`` is set."""
        self.authorize(request)
        self.check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise bad_request("the prompt is empty", "prompt")
        check_unicode([p for p in prompts if isinstance(p, str)], "prompt")
        params = engine_fields(req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        subs = await self.open_all(self._payloads(prompts, False, params, req.n, rid, bool(req.stream)), req)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return sse_response(subs, self._events(subs), rid, "text_completion", self.model_name, include_usage,
                                req.n, req.logprobs is not None, self.settings.sse_keepalive_s)
        await collect(subs, self._events(subs), self.settings.retry_after_s)
        return completion_response(subs, rid, self.model_name, req.n, req.logprobs is not None)

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        """``POST /v1/chat/completions`` (the model's chat template): JSON, or SSE chunks when ``stream`` is set."""
        self.authorize(request)
        self.check_model(req.model)
        messages = message_dicts(req.messages)
        params = engine_fields(req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        subs = await self.open_all(self._payloads([messages], True, params, req.n, rid, bool(req.stream)), req)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return sse_response(subs, self._events(subs), rid, "chat.completion.chunk", self.model_name,
                                include_usage, req.n, bool(req.logprobs), self.settings.sse_keepalive_s)
        await collect(subs, self._events(subs), self.settings.retry_after_s)
        return chat_response(subs, rid, self.model_name, req.n, bool(req.logprobs))

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
            payload: dict[str, Any] = {"messages": message_dicts(req.messages)}
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

