"""The FastAPI app of the OpenAI endpoints, the admin views, ``/health`` and ``/metrics``, around
an :class:`~lserve.serve.ingress.OpenAIServer`; its OpenAPI schema lists 400 (never 422) for bad
input and describes each SSE event of a streaming response."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response

from lserve.serve.error_handlers import add_error_handlers
from lserve.serve.ingress import OpenAIServer
from lserve.serve.lifecycle import shutting_down_error
from lserve.serve.metrics import render_metrics
from lserve.serve.middleware import DRAIN_PATH, BodyLimitMiddleware, GuardMiddleware
from lserve.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
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
    TokenizeRequest,
    TokenizeResponse,
)

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

    add_error_handlers(app)

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
        source = "broadcast" if reported is None else "reports"
        replicas = await server.engine_stats() if reported is None else reported
        # the evicted prefixes' hashes are the router's business (up to a few hundred numbers)
        replicas = [{k: v for k, v in r.items() if k != "prefix_evicted"} for r in replicas]
        return {"model": server.model_name, "source": source, "replicas": replicas}

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
