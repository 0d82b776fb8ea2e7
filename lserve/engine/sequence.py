"""Per-request state: tokens, KV pages, detokenization and stop checks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from lserve.engine.sampling import SamplingParams

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
        if (not p.ignore_eos and tok in eos_ids) or tok in p.stop_token_ids:
            self.finish_reason = "stop"  # the stop token itself is not part of the text
            self.output_ids.append(tok)
            return
        self.output_ids.append(tok)
        self._detokenize(tokenizer)
        if p.stop:
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
        self._emitted_tokens = len(self.output_ids)
        return RequestOutput(self.request_id, self.prompt_ids, list(self.output_ids), self.text[:visible],
                             delta, new_ids, finished, self.finish_reason, self.metrics())

    def metrics(self) -> dict:
        m = {"arrival": self.arrival, "first_scheduled": self.first_scheduled,
             "first_token": self.first_token_time, "num_preemptions": self.num_preemptions,
             "prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.output_ids)}
        if self.first_token_time is not None:
            m["ttft_s"] = self.first_token_time - self.arrival
        return m
