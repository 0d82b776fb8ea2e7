"""OpenAI request fields -> the engine's sampling fields, and the API's own rules about them.

:func:`engine_fields` maps a completion or chat request to the ``params`` of an engine request
(:class:`lserve.engine.sampling.SamplingParams` fields); fields LServe does not implement are
refused with 400 instead of being ignored.
"""

from __future__ import annotations

from typing import Any

from lserve.engine.sampling import SamplingParams
from lserve.serve.protocol import (
    MAX_STOP,
    MAX_STOP_CHARS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    bad_request,
)

NEUTRAL_RESPONSE_FORMAT = {"type": "text"}


def check_unicode(texts, param: str) -> None:
    """400 for text holding a lone UTF-16 surrogate (JSON ``"\\ud800"``): no tokenizer can encode it."""
    for s in texts:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad_request(f"{param} contains an unpaired UTF-16 surrogate (U+{ord(s[e.start]):04X} at character "
                              f"{e.start}), which is not valid Unicode text", param) from None


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Chat messages as the engine's chat template takes them (text parts joined; 400 for lone surrogates)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        check_unicode([content], f"messages.{i}.content")
        out.append({"role": m.role, "content": content})
    return out


def engine_fields(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """Engine sampling fields from an OpenAI request (400 for what the API itself refuses).

    The ranges of the fields are the engine's rules (:mod:`lserve.engine.request_check`), applied
    here before admission (:func:`check_sampling`) and again by the replica; :func:`api_param`
    names the request field behind an engine field.
    """
    refuse_unsupported(req)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise bad_request(f"at most {MAX_STOP} stop strings are allowed, got {len(stop)}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad_request(f"stop strings must have at most {MAX_STOP_CHARS} characters", "stop")
    check_unicode(stop, "stop")
    extra: dict[str, Any] = {}
    if req.lserve is not None:
        if req.lserve.streaming is False:
            raise bad_request("lserve.streaming=false is not supported on this deployment: streaming heads are "
                              "fixed when the engine starts and cannot be switched off per request",
                              "lserve.streaming")
        if req.lserve.token_budget is not None:
            extra["token_budget"] = req.lserve.token_budget
        if req.lserve.prefix_cache is False:
            extra["prefix_cache"] = False
        if req.lserve.prefill_sparsity is not None:
            extra["prefill_sparsity"] = req.lserve.prefill_sparsity
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    fields = {"max_tokens": max_tokens, "temperature": 1.0 if req.temperature is None else req.temperature,
              "top_p": 1.0 if req.top_p is None else req.top_p, "top_k": req.top_k or 0, "seed": req.seed,
              "stop": stop, "ignore_eos": req.ignore_eos, "presence_penalty": req.presence_penalty,
              "frequency_penalty": req.frequency_penalty,
              "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
              "logit_bias": req.logit_bias or None, "min_tokens": req.min_tokens, **logprob_fields(req), **extra}
    check_sampling(req, fields)
    return fields


def check_sampling(req: CompletionRequest | ChatCompletionRequest, fields: dict[str, Any]) -> None:
    """The engine's rules on the sampling fields alone (:meth:`RequestCheck.params
    <lserve.engine.request_check.RequestCheck.params>`, run by :class:`SamplingParams`), here too, so
    that a bad request gets its 400 before it takes an admission slot; the replica applies them again
    with the real ``max_tokens`` and adds the rules that need the engine (context, pages)."""
    p = {k: v for k, v in fields.items() if k != "echo"}
    if p["max_tokens"] is None:  # the replica fills it from the room left; any valid value checks the rest
        p["max_tokens"] = max(1, p.get("min_tokens") or 0)
    try:
        SamplingParams(**p)
    except (ValueError, TypeError) as e:  # RequestError (a ValueError) names the engine field
        raise bad_request(str(e), api_param(req, getattr(e, "param", None))) from None


def api_param(req: CompletionRequest | ChatCompletionRequest, engine_param: str | None) -> str | None:
    """The request field behind an engine field that an engine error names."""
    if engine_param in ("token_budget", "prefill_sparsity", "prefix_cache"):
        return f"lserve.{engine_param}"
    if isinstance(req, ChatCompletionRequest):
        if engine_param == "logprobs":
            return "top_logprobs"
        if engine_param == "max_tokens" and req.max_completion_tokens is not None:
            return "max_completion_tokens"
    elif engine_param == "prompt_logprobs":  # echo's prompt logprobs are the request's logprobs
        return "logprobs"
    return engine_param


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


def logprob_fields(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """``logprobs`` / ``top_logprobs`` / ``echo`` as engine fields (``echo`` is read by the replica)."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return {"logprobs": (req.top_logprobs or 0) if req.logprobs else None}
    prompt_logprobs = None
    if req.echo:  # max_tokens 0 generates nothing: the engine then only runs the prompt (and scores it)
        prompt_logprobs = req.logprobs if req.logprobs is not None else (0 if req.max_tokens == 0 else None)
    return {"logprobs": req.logprobs, "prompt_logprobs": prompt_logprobs, "echo": req.echo}

