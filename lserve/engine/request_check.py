"""Every rule a request must pass before the engine takes it, in one place.

:meth:`RequestCheck.params` holds the rules on the sampling fields alone (ranges, types, fields
that depend on each other); :class:`~lserve.engine.sampling.SamplingParams` runs it when it is
made. :meth:`RequestCheck.request` holds the rules that depend on the engine (vocabulary, context
length, KV pages, the backend); :meth:`LLMEngine.check_request` runs it before a request is
queued. Both raise :class:`RequestError` naming the offending field, which the serving layer
answers as an HTTP 400 for that request field.
"""

from __future__ import annotations

from typing import Any

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's chat limit; the server caps completions at 5)
MAX_TEMPERATURE = 100.0  # the engine's own bound; the OpenAI API caps at 2 (lserve.serve.protocol)
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds; the server adds the choice index to it
MAX_BIAS = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_PENALTY = 2.0


class RequestError(ValueError):
    """A request the engine cannot serve (too long, bad parameters); message for the user.

    ``param`` names the offending :class:`~lserve.engine.sampling.SamplingParams` field (None:
    the prompt); ``code`` is the OpenAI error code the serving layer answers with (e.g.
    ``context_length_exceeded``).
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _in(v: Any, lo: float, hi: float, lo_open: bool = False) -> bool:
    """``v`` a number in [lo, hi] (``(lo, hi]`` with ``lo_open``); NaN never is."""
    return _number(v) and (lo < v if lo_open else lo <= v) and v <= hi


def _token_id(key: Any) -> bool:
    """A token id as a number or as JSON object keys carry it (a string of digits)."""
    return (_integer(key) and key >= 0) or (isinstance(key, str) and key.isdecimal())


class RequestCheck:
    """The request rules of one engine.

    Parameters
    ----------
    vocab_size, max_model_len, page_size : int
    num_pages : int
        Dense KV pages of the cache (a request needing more can never run).
    backend : str
        The attention backend's name (for messages).
    prefill_sparsity_ok : bool
        Whether the backend runs block-sparse prefill.
    """

    def __init__(self, vocab_size: int, max_model_len: int, page_size: int, num_pages: int, backend: str,
                 prefill_sparsity_ok: bool) -> None:
        self.vocab_size, self.max_model_len, self.page_size = vocab_size, max_model_len, page_size
        self.num_pages, self.backend, self.prefill_sparsity_ok = num_pages, backend, prefill_sparsity_ok

    @staticmethod
    def params(p) -> None:
        """Raise :class:`RequestError` unless the sampling fields of ``p`` are valid on their own.

        Parameters
        ----------
        p : lserve.engine.sampling.SamplingParams
            ``stop`` already a list; ``logit_bias`` keys still as given (ints or digit strings).
        """
        def need(ok: bool, param: str, msg: str) -> None:
            if not ok:
                raise RequestError(msg, param)

        scoring = p.prompt_logprobs is not None
        need(_integer(p.max_tokens) and (p.max_tokens >= 1 or (p.max_tokens == 0 and scoring)), "max_tokens",
             f"max_tokens must be an integer >= 1 (0 only when the prompt is scored: prompt logprobs, echo: true "
             f"on /v1/completions), got {p.max_tokens!r}")
        need(_in(p.temperature, 0.0, MAX_TEMPERATURE), "temperature",
             f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {p.temperature!r}")
        need(_in(p.top_p, 0.0, 1.0, lo_open=True), "top_p", f"top_p must be in (0, 1], got {p.top_p!r}")
        need(_integer(p.top_k) and p.top_k >= -1, "top_k", f"top_k must be -1, 0 or a positive integer, got {p.top_k!r}")
        need(p.seed is None or (_integer(p.seed) and 0 <= p.seed <= MAX_SEED), "seed",
             f"seed must be an integer in [0, {MAX_SEED}], got {p.seed!r}")
        need(all(isinstance(s, str) and s for s in p.stop), "stop", "stop strings must be non-empty strings")
        need(p.token_budget is None or (_integer(p.token_budget) and p.token_budget >= 0), "token_budget",
             f"token_budget must be an integer >= 0 (0: selection off), got {p.token_budget!r}")
        need(p.prefill_sparsity is None or _in(p.prefill_sparsity, 0.0, 1.0), "prefill_sparsity",
             f"prefill_sparsity must be in [0, 1], got {p.prefill_sparsity!r}")
        need(_integer(p.min_tokens) and p.min_tokens >= 0, "min_tokens",
             f"min_tokens must be an integer >= 0, got {p.min_tokens!r}")
        need(p.min_tokens <= max(p.max_tokens, 0), "min_tokens",
             f"min_tokens ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(p, name)
            need(_in(v, -MAX_PENALTY, MAX_PENALTY), name, f"{name} must be in [-2, 2], got {v!r}")
        need(_in(p.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, lo_open=True), "repetition_penalty",
             f"repetition_penalty must be in (0, 100], got {p.repetition_penalty!r}")
        for key, bias in (p.logit_bias or {}).items():
            need(_token_id(key), "logit_bias",
                 f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
            need(_in(bias, -MAX_BIAS, MAX_BIAS), "logit_bias",
                 f"logit_bias values must be in [-100, 100], got {bias!r} for token {key}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(p, name)
            need(v is None or (_integer(v) and 0 <= v <= MAX_LOGPROBS), name,
                 f"{name} must be in [0, {MAX_LOGPROBS}], got {v!r}")
        need(isinstance(p.prefix_cache, bool), "prefix_cache", f"prefix_cache must be true or false, got "
                                                               f"{p.prefix_cache!r}")

    def request(self, prompt_ids: list[int], p) -> None:
        """Raise :class:`RequestError` if this engine can never serve ``prompt_ids`` with ``p``
        (a :class:`~lserve.engine.sampling.SamplingParams` that passed :meth:`params`)."""
        vocab = self.vocab_size
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        bad = [t for t in p.logit_bias or {} if t >= vocab]
        if bad:
            raise RequestError(f"logit_bias token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "logit_bias")
        total = len(prompt_ids) + p.max_tokens
        if total > self.max_model_len:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens, but the "
                               f"request asks for {total} ({len(prompt_ids)} in the prompt + {p.max_tokens} "
                               f"to generate)", code=CONTEXT_LENGTH_EXCEEDED)
        if p.prefill_sparsity and not self.prefill_sparsity_ok:
            raise RequestError(f"prefill_sparsity is not supported by the {self.backend!r} backend", "prefill_sparsity")
        tb, page = p.token_budget, self.page_size
        if tb is not None and 0 < tb < 2 * page:
            raise RequestError(f"token_budget must be 0 (selection off) or at least two KV pages ({2 * page} "
                               f"tokens), got {tb}", "token_budget")
        if tb is not None and tb > self.max_model_len:
            raise RequestError(f"token_budget ({tb}) exceeds the model's context length ({self.max_model_len})",
                               "token_budget")
        pages = -(-total // page)
        if pages > self.num_pages:
            raise RequestError(f"the request needs {pages} KV pages ({total} tokens) but the cache has "
                               f"{self.num_pages}", code=CONTEXT_LENGTH_EXCEEDED)
