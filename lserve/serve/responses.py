"""Engine events -> OpenAI responses: each choice's text, logprobs and usage folded from its
events, answered as one JSON body or as SSE chunks (``data: [DONE]`` last).

A stream whose 200 has been sent reports a later failure in-band (:func:`stream_error`); a
non-streaming request still gets a proper status.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from lserve.serve.admission import SubRequest
from lserve.serve.logprobs import chat_logprobs, completion_logprobs
from lserve.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    OpenAIError,
    PromptTokensDetails,
    Usage,
)
from lserve.serve.streams import KEEPALIVE, SSE_KEEPALIVE, keepalives

log = logging.getLogger("lserve.serve")

REPLICA_HEADER = "x-lserve-replica"
_FINISH = {"stop": "stop", "length": "length"}


def stream_error(e: BaseException) -> dict[str, Any]:
    """The in-band SSE error event for a stream that fails after its 200 was sent."""
    if isinstance(e, OpenAIError):
        return e.body()
    return {"error": {"message": "the engine failed while generating; retry", "type": "service_unavailable",
                      "param": None, "code": "service_unavailable"}}


def apply_event(sub: SubRequest, ev: dict[str, Any]) -> str:
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


def usage(subs: list[SubRequest], n: int) -> Usage:
    """Token usage of an HTTP request's choices (``n`` choices per prompt)."""
    prompt = sum(s.prompt_tokens for s in subs if s.index % n == 0)  # each prompt counted once
    cached = sum(s.cached_tokens for s in subs if s.index % n == 0)
    completion = sum(s.completion_tokens for s in subs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def collect(subs: list[SubRequest], events: AsyncIterator, retry_after_s: float) -> None:
    """Fold every event of ``events`` into its choice (503 when a replica dies mid-request)."""
    try:
        async for sub, ev in events:
            apply_event(sub, ev)
    except OpenAIError:
        raise
    except Exception as e:  # noqa: BLE001 - a replica died mid-request
        log.warning("engine stream failed: %r", e)
        raise OpenAIError(503, "the engine failed while generating; retry", "service_unavailable", None,
                          "service_unavailable", {"Retry-After": str(max(1, round(retry_after_s)))}) from None
    finally:
        for s in subs:
            s.cancel()


def completion_response(subs: list[SubRequest], rid: str, model: str, n: int, logprobs: bool) -> JSONResponse:
    """The ``text_completion`` body of collected choices."""
    choices = [CompletionChoice(index=s.index, text="".join(s.text), finish_reason=_FINISH.get(s.finish_reason),
                                logprobs=CompletionLogprobs(**completion_logprobs(s.logprobs, 0)[0]) if logprobs
                                else None)
               for s in subs]
    body = CompletionResponse(id=rid, model=model, choices=choices, usage=usage(subs, n))
    return JSONResponse(body.model_dump(), headers={REPLICA_HEADER: subs[0].first.get("replica", "")})


def chat_response(subs: list[SubRequest], rid: str, model: str, n: int, logprobs: bool) -> JSONResponse:
    """The ``chat.completion`` body of collected choices."""
    choices = [ChatChoice(index=s.index, message=AssistantMessage(content="".join(s.text)),
                          logprobs=ChatLogprobs(**chat_logprobs(s.logprobs)) if logprobs else None,
                          finish_reason=_FINISH.get(s.finish_reason)) for s in subs]
    body = ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage(subs, n))
    return JSONResponse(body.model_dump(), headers={REPLICA_HEADER: subs[0].first.get("replica", "")})


def sse_response(subs: list[SubRequest], events: AsyncIterator, rid: str, obj: str, model: str,
                 include_usage: bool, n: int, logprobs: bool, keepalive_s: float) -> StreamingResponse:
    """SSE chunks of ``obj`` (``text_completion`` or ``chat.completion.chunk``) from ``events``,
    with a keep-alive comment after each ``keepalive_s`` of silence."""
    created = int(time.time())
    chat = obj == "chat.completion.chunk"

    def chunk(choices: list[dict], usage_: dict | None = None, with_usage: bool = include_usage) -> str:
        body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
        if with_usage:
            body["usage"] = usage_
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
                async for item in keepalives(events, keepalive_s):
                    if item is KEEPALIVE:
                        yield SSE_KEEPALIVE
                        continue
                    sub, ev = item
                    text = apply_event(sub, ev)
                    finish = _FINISH.get(sub.finish_reason) if ev.get("finished") else None
                    if text or finish or (logprobs and sub.new_logprobs):
                        yield chunk([choice(sub, text if text else None, finish)])
            except Exception as e:  # noqa: BLE001 - reported in-band: the 200 has been sent
                log.warning("stream %s failed: %r", rid, e)
                yield f"data: {json.dumps(stream_error(e))}\n\n"
            else:
                if include_usage:
                    yield chunk([], usage(subs, n).model_dump())
            yield "data: [DONE]\n\n"
        finally:  # also on client disconnect: cancelling the engine streams aborts the requests
            for s in subs:
                s.cancel()

    headers = {REPLICA_HEADER: subs[0].first.get("replica", ""), "Cache-Control": "no-cache"}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
