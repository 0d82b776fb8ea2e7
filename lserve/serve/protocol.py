"""OpenAI-compatible request/response models and the error shape.

Requests are validated strictly (wrong JSON types are rejected, not coerced); the ranges of the
sampling fields are the engine's rules (:mod:`lserve.engine.request_check`), checked once there and
answered as 400 naming the request field. Parameters LServe does not implement (tools, structured
output, ``best_of``, ``suffix``) are accepted only at their neutral values and answered 400
otherwise, so a client never gets silently different behaviour. vLLM's ``repetition_penalty``,
``min_tokens``, ``top_k`` and ``ignore_eos`` are accepted too. The ``lserve`` object is LServe's per-request extension.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 8  # n times the number of prompts, per request
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions (vLLM allows 20)


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

    Parameters
    ----------
    status : int
    message : str
        One line for the user (never a stack trace).
    type : str
        OpenAI's error type, e.g. ``invalid_request_error``.
    param : str or None
        The offending request field.
    code : str or None
        A machine-readable code, e.g. ``context_length_exceeded``.
    headers : dict, optional
        Extra response headers (``Retry-After``, ``WWW-Authenticate``).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """HTTP 400 ``invalid_request_error``."""
    return OpenAIError(400, message, "invalid_request_error", param, code)


# -- requests ---------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class LServeOptions(BaseModel):
    """Per-request sparsity settings (the ``lserve`` extension object)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    token_budget: int | None = Field(
        None, description="Dense heads' decode token budget for this request: 0 turns page selection off, "
                          "otherwise at least two KV pages and at most the model's context length.")
    prefill_sparsity: float | None = Field(
        None, description="Block-sparse prefill of dense heads for this request: the estimated attention mass "
                          "each query block keeps (0 off, 1 every causal block); torch and cupy backends.")
    streaming: bool | None = Field(
        None, description="Streaming heads on/off. Only true (or absent) is accepted: this deployment cannot switch "
                          "streaming heads off per request.")
    prefix_cache: bool | None = Field(
        None, description="false: this request neither reuses cached prompt pages nor leaves its own in the "
                          "replica's prefix cache (default true).")


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="Send a last chunk with token usage and no choices.")


class _SamplingRequest(_Strict):
    model: str | None = Field(None, description="The served model id (see GET /v1/models); default: that model.")
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2, description="0..2 (OpenAI's range; the engine allows more "
                                                                     "offline). 0: greedy.")
    top_p: float | None = None
    top_k: int | None = Field(None, description="0 or -1 disables.")
    seed: int | None = None
    stop: str | list[str] | None = Field(None, description=f"Up to {MAX_STOP} stop strings.")
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, description="Subtracted from the logit of every token generated so far.")
    frequency_penalty: float = Field(0.0, description="Times a token's count in the generated text, subtracted from "
                                                      "its logit.")
    repetition_penalty: float | None = Field(
        None, description="vLLM's: divides the positive logits (multiplies the negative ones) of tokens in the "
                          "prompt or the generated text; 1 is off.")
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100] added to its logit.")
    min_tokens: int = Field(0, description="EOS, stop_token_ids and stop strings do not end the output before "
                                           "this many tokens.")
    response_format: dict[str, Any] | None = Field(
        None, description='Only {"type": "text"} (or null): structured output is not supported.')
    user: str | None = None
    lserve: LServeOptions | None = None


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="Text, token ids, or a batch of either (each prompt gets n choices).")
    max_tokens: int | None = Field(16, description="0 only with echo (score the prompt).")
    echo: bool = Field(False, description="Prepend the prompt to the text (and, with logprobs, its tokens' "
                                          "logprobs; the first prompt token's is null).")
    # OpenAI's cap for this endpoint, tighter than the engine's (chat allows 20)
    logprobs: int | None = Field(None, le=MAX_COMPLETION_LOGPROBS,
                                 description="Each token's logprob and this many most likely alternatives.")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description="Only 1 (or null) is supported.")
    suffix: str | None = Field(None, description="Not supported (null only).")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] = Field(..., description="Required: messages without content (tool calls) are not "
                                                           "supported.")
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions`` (the model's chat template is applied)."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = Field(None, description="Return each generated token's logprob.")
    top_logprobs: int | None = Field(None, description="With logprobs: this many most likely alternatives per token.")
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported (null or empty only).")
    tool_choice: str | dict[str, Any] | None = Field(None, description='Not supported (null or "none" only).')
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = Field(None, description="Not supported (null or empty only).")
    function_call: str | dict[str, Any] | None = Field(None, description='Not supported (null or "none" only).')


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's shape): a text ``prompt`` or chat ``messages``, not both."""

    model: str | None = Field(None, description="The served model id; default: that model.")
    prompt: str | None = Field(None, description="Text to tokenize as a completion prompt.")
    messages: list[ChatMessage] | None = Field(None, min_length=1,
                                               description="A chat, tokenized with the model's chat template.")
    add_special_tokens: bool | None = Field(None, description="Prompt: add BOS and the like (default true). Messages: "
                                                              "only false (the template adds its own).")
    add_generation_prompt: bool = Field(True, description="Messages: open the assistant's turn (only true).")


#: Longest grace period ``POST /admin/drain`` accepts (an hour; a drain cannot be undone).
MAX_DRAIN_GRACE_S = 3600.0


class DrainRequest(BaseModel):
    """``POST /admin/drain``: the grace period running requests get (default: the server's ``shutdown_grace_s``)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    grace_s: float | None = Field(None, ge=0, le=MAX_DRAIN_GRACE_S, allow_inf_nan=False,
                                  description="Seconds running requests get before they are ended with an error.")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = Field(None, description="The served model id; default: that model.")
    tokens: list[int] = Field(..., description="Token ids to turn back into text (special tokens are left out).")


class DetokenizeResponse(BaseModel):
    prompt: str


# -- responses --------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens whose KV came from the prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """Per token of the choice's text (the prompt's first when echoed): OpenAI's legacy shape."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lserve"
    max_model_len: int | None = None
    sparsity: dict[str, Any] | None = Field(None, description="The sparsity in effect: head pattern (and whether "
                                            "'auto' found a shipped one for this model), token budget, layer "
                                            "selection, adaptive budgets, prefill sparsity, and `summary`: "
                                            "all of it in one line, as `lserve serve` prints it at start.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: Literal["ok"]
    replicas: int = Field(description="Engine replicas that answered healthy.")
