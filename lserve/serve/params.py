"""OpenAI request fields -> the engine's sampling fields, and the API's own rules about them.

:func:`engine_fields` maps a completion or chat request to the ``params`` of an engine request
(:class:`lserve.engine.sampling.SamplingParams` fields); fields LServe does not implement are
refused with 400 instead of being ignored.
"""

from __future__ import annotations

from typing import Any

from lserve.serve.protocol import (
    MAX_STOP,
    MAX_STOP_CHARS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    bad_request,
)

GREEDY_BELOW = 1e-5
MIN_TOP_P = 1e-6
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


def engine_fields(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, page_size: int,
                  max_model_len: int | None) -> dict[str, Any]:
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
            page = page_size
            if 0 < token_budget < 2 * page:
                raise bad_request(f"lserve.token_budget must be 0 (selection off) or at least two KV pages "
                                  f"({2 * page} tokens), got {token_budget}", "lserve.token_budget")
            if max_model_len and token_budget > max_model_len:
                raise bad_request(f"lserve.token_budget ({token_budget}) exceeds the model's context length "
                                  f"({max_model_len})", "lserve.token_budget")
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature < GREEDY_BELOW:  # dividing logits by ~0 overflows: treat as greedy (like vLLM)
        temperature = 0.0
    # A top_p that rounds to 0 in float32 would drop every token: it means "the top token only".
    top_p = 1.0 if req.top_p is None else max(req.top_p, MIN_TOP_P)
    return {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": req.top_k or 0,
            "seed": req.seed, "stop": stop, "ignore_eos": req.ignore_eos, "token_budget": token_budget,
            **logit_fields(req, max_tokens), **logprob_fields(req), **extra}


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

