"""OpenAI's error JSON for every failure of the app: its own errors, FastAPI's validation errors
(400, not 422, naming the field), Starlette's HTTP errors and anything unexpected (500, logged,
never a stack trace in the body)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lserve.serve.protocol import OpenAIError, bad_request

log = logging.getLogger("lserve.serve")


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in OpenAI's shape (:meth:`OpenAIError.body`)."""

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
