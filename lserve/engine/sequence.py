"""Per-request state: tokens, KV pages, detokenization and stop checks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

import torch

from lserve.engine.sampling import SamplingParams, TokenLogprob

PLACEHOLDER = -1  # an output id whose token is still on the device (never a vocabulary id)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """A snapshot of one request, returned by every engine step that touched it.

    ``delta_text``/``delta_token_ids`` are what is new since the previous snapshot.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # every generated token's, when asked for
    delta_logprobs: list[TokenLogprob] | None = None  # those of ``delta_token_ids``
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first None), once complete

    def then(self, later: RequestOutput) -> RequestOutput:
        """``later`` (the next snapshot of the same request) with this one's deltas in front: one
        snapshot for a consumer that had not read this one yet."""
        lps = None
        if self.delta_logprobs is not None or later.delta_logprobs is not None:
            lps = (self.delta_logprobs or []) + (later.delta_logprobs or [])
        return replace(later, delta_text=self.delta_text + later.delta_text,
                       delta_token_ids=self.delta_token_ids + later.delta_token_ids, delta_logprobs=lps,
                       prompt_logprobs=later.prompt_logprobs if later.prompt_logprobs is not None
                       else self.prompt_logprobs)


class Sequence:
    """One request inside the engine.

    ``num_computed`` tokens of ``prompt_ids + output_ids`` have their KV in the cache;
    ``in_decode`` is set once the whole sequence has been prefilled (reset on preemption).
    With async decode the last of ``output_ids`` can be a placeholder (:meth:`reserve_token`)
    while the step that samples it runs; :meth:`append_token` replaces it.
    """

    def __init__(self, seq_id: int, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 arrival: float | None = None) -> None:
        self.seq_id, self.request_id = seq_id, request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.num_computed = 0
        self.in_decode = False
        self.reserved = False  # the last output id is a placeholder (async decode)
        self.dense_pages: list[int] = []
        self.stream_pages: list[int] = []
        self.generator: torch.Generator | None = None
        # Logprobs (see lserve.engine.sampling): per generated token, and per prompt token once
        # prefill computed them (the first prompt token has none).
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if params.prompt_logprobs is not None else None
        self._prompt_mask: torch.Tensor | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        # Detokenization state (incremental, windowed).
        self.text = ""
        self._prefix_offset = self._read_offset = 0
        self._emitted_chars = 0
        self._emitted_tokens = 0
        # Timings.
        self.arrival = time.monotonic() if arrival is None else arrival
        self.first_scheduled: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.num_preemptions = 0
        self.prompt_counted = False  # its prompt tokens are in the engine's prompt_tokens counter
        # Prefix cache (the scheduler's): prompt tokens reused at the first admission; whether this
        # sequence's prompt pages may be indexed (only pages prefilled through the scheduler have
        # their streaming shadows written), how many leading ones are, the entry of the last one.
        self.num_cached_tokens: int | None = None
        self.cacheable = False
        self.prefix_pages = 0
        self.prefix_parent = None
        self._page_hashes: list[int] | None = None

    def page_hashes(self, prefix) -> list[int]:
        """Chained hashes of the prompt's full pages under ``prefix`` (a PrefixCache; computed once)."""
        if self._page_hashes is None:
            self._page_hashes = prefix.hashes(self.prompt_ids)
        return self._page_hashes

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if start >= n:  # decode: no copy of the (possibly 100k-token) prompt
            return self.output_ids[start - n: end - n]
        return (self.prompt_ids[start:end] + self.output_ids[: max(0, end - n)])

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def ends_by_length(self, max_model_len: int, ahead: int = 1) -> bool:
        """Whether the sequence is at ``max_tokens`` or ``max_model_len`` once ``ahead`` more tokens
        are appended (``ahead=0``: now; :meth:`append_token`'s length stop)."""
        return len(self.output_ids) + ahead >= self.params.max_tokens or self.num_tokens + ahead >= max_model_len

    def prompt_logprob_span(self, start: int, n: int) -> tuple[int, int]:
        """Positions ``[lo, hi)`` of a prefill chunk ``[start, start + n)`` whose logits give a
        prompt token's logprob not recorded yet (position p scores prompt token p + 1; a
        recompute after preemption scores nothing twice). Empty unless prompt logprobs were asked."""
        if self.prompt_logprobs is None:
            return 0, 0
        lo = max(start, len(self.prompt_logprobs) - 1)
        hi = min(start + n, len(self.prompt_ids) - 1)
        return lo, max(lo, hi)

    def prompt_token_mask(self, vocab: int, device) -> torch.Tensor:
        """bool [vocab] on ``device``: the tokens of the prompt (built once; repetition penalty)."""
        m = self._prompt_mask
        if m is None or m.numel() != vocab or m.device != torch.device(device):
            m = torch.zeros(vocab, dtype=torch.bool, device=device)
            m[torch.tensor([t for t in self.prompt_ids if t < vocab], dtype=torch.long, device=device)] = True
            self._prompt_mask = m
        return m

    def reserve_token(self) -> None:
        """Hold the place of a token still being sampled on the device, so the step after it can
        be scheduled (positions, pages); :meth:`append_token` puts the real token there."""
        self.output_ids.append(PLACEHOLDER)
        self.reserved = True

    def append_token(self, tok: int, tokenizer, eos_ids: tuple[int, ...], max_model_len: int) -> None:
        """Add a sampled token (in place of a reserved one), update the text and decide whether to stop."""
        if self.reserved:
            self.output_ids.pop()
            self.reserved = False
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)
        p = self.params
        # min_tokens: nothing stops the request before that many tokens (vLLM's rule)
        stops = len(self.output_ids) + 1 >= p.min_tokens
        if stops and ((not p.ignore_eos and tok in eos_ids) or tok in p.stop_token_ids):
            self.finish_reason = "stop"  # the stop token itself is not part of the text
            self.output_ids.append(tok)
            return
        self.output_ids.append(tok)
        self._detokenize(tokenizer)
        if p.stop and stops:
            for s in p.stop:
                # Only the new tail can hold a fresh match.
                at = self.text.find(s, max(0, self._emitted_chars - len(s)))
                if at >= 0:
                    self.text = self.text[:at]
                    self.finish_reason = "stop"
                    return
        if self.ends_by_length(max_model_len, ahead=0):
            self.finish_reason = "length"

    def _detokenize(self, tokenizer) -> None:
        ids = self.output_ids
        prefix = tokenizer.decode(ids[self._prefix_offset: self._read_offset])
        full = tokenizer.decode(ids[self._prefix_offset:])
        if full.endswith("\ufffd"):
            return  # an incomplete UTF-8 character: wait for the next token
        self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)

    def snapshot(self) -> RequestOutput:
        """The output so far; advances the 'already emitted' marks."""
        finished = self.finish_reason is not None
        hold = 0 if finished else max((len(s) - 1 for s in self.params.stop), default=0)
        visible = max(self._emitted_chars, len(self.text) - hold)
        delta = self.text[self._emitted_chars: visible]
        self._emitted_chars = visible
        new_ids = self.output_ids[self._emitted_tokens:]
        lps = delta_lps = None
        if self.logprobs is not None:
            lps, delta_lps = list(self.logprobs), self.logprobs[self._emitted_tokens:]
        self._emitted_tokens = len(self.output_ids)
        done = self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.prompt_ids)
        return RequestOutput(self.request_id, self.prompt_ids, list(self.output_ids), self.text[:visible],
                             delta, new_ids, finished, self.finish_reason, self.metrics(), lps, delta_lps,
                             self.prompt_logprobs if done else None)

    def metrics(self) -> dict:
        m = {"arrival": self.arrival, "first_scheduled": self.first_scheduled,
             "first_token": self.first_token_time, "num_preemptions": self.num_preemptions,
             "prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.output_ids),
             "cached_tokens": self.num_cached_tokens or 0}
        if self.first_token_time is not None:
            m["ttft_s"] = self.first_token_time - self.arrival
        return m
