"""The ASGI layers around the OpenAI app: the API key, the drain's refusals, response counting
and the body size limit.

:class:`GuardMiddleware`, the outermost layer, checks the API key before anything reads the body,
refuses requests while a shutdown drains and counts every response once (499 for a client that
left); :class:`BodyLimitMiddleware` answers 413 for bodies over the limit.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lserve.serve.lifecycle import shutting_down_error
from lserve.serve.protocol import OpenAIError


def auth_error(api_key: str | None, auth: str) -> OpenAIError | None:
    """The 401 for an ``Authorization`` header value without ``api_key`` (None if it has it or none is set)."""
    if api_key is None:
        return None
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return None
    msg = "Incorrect API key provided." if auth else "Missing API key: send 'Authorization: Bearer <key>'."
    return OpenAIError(401, msg, "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


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
    * While the server drains (:class:`~lserve.serve.lifecycle.Lifecycle`), every request but the probes and
      :data:`DRAIN_PATH` gets 503; those are not counted as requests in flight either.
    * A client that goes away is not a server error: the request ends quietly (no traceback)
      and is counted with status :data:`CLIENT_CLOSED`.
    * Every response except the probes' is counted once in ``lserve:http_responses_total``, by
      route and status, when it has been sent (a stream when it ends).

    Parameters
    ----------
    app
        The ASGI app inside.
    server : lserve.serve.ingress.OpenAIServer
        Read for ``api_key``, ``lifecycle``, ``settings.retry_after_s`` and ``http_metrics``.
    routes : list
        The app's routes (to label a request refused before routing).
    """

    def __init__(self, app, server, routes: list) -> None:
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
            err = auth_error(self.server.api_key, auth)
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
