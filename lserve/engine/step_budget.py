"""How much prefill one engine step may carry: a token cap, and optionally a time target.

A step's latency is what every running request waits for: decoding requests get their next
token after it, a request that just arrived gets its first token one or two steps later. So a
long prompt is prefilled in chunks whose *cost* is bounded, not only their token count:

* Cost is counted in token-equivalents. A chunk of ``n`` prompt tokens that starts after ``s``
  cached ones costs ``n * (1 + alpha * (s + n / 2))``: the weight matmuls per token plus the
  dense heads' attention to the past, ``alpha`` being the ratio of attention FLOPs per
  (query, key) pair to matmul FLOPs per token (:func:`attention_alpha`; streaming heads read a
  constant window and are left out). A chunk near the end of a 128k prompt of Llama-3-8B with
  half the heads streaming costs ~3.4x one at its start.
* Without a time target (``step_time_target = 0``, the engine's default) a step carries at most
  ``max_batched_tokens`` tokens and at most the cost of prefilling that many from an empty cache
  (decodes included, deterministically): a prompt of ``max_batched_tokens`` tokens is one step,
  as in vLLM, and chunks deeper into a longer prompt carry fewer tokens for the same cost.
* With one (``lserve serve``'s default), the budget follows measured speed. A step is modelled
  as ``overhead + cost / rate``: ``rate`` (token-equivalents per second) is learnt from steps
  that only prefill, times the target gives their budget. A step that also decodes is timed in
  two parts where the engine can (CUDA events around its prefill forward, which runs after the
  decodes' graph replay): its prefill's own rate, and the rest of the step (decodes, launches).
  Its prefill may take ``decode_stall`` times the larger of that rest and a decode-only step's
  time, at the rate prefill runs next to decodes, which differs from a prefill-only step's (on
  the H200 a long prompt's chunks next to decodes run flash, its grid-aligned prefill-only
  chunks cuDNN, ~1.5x faster). Running requests then see inter-token gaps of about
  ``1 + decode_stall`` step times while a prompt is prefilled, and the prompt still moves in
  sizeable chunks. Where the parts cannot be timed apart (one eager forward, e.g. on a CPU) the
  rest is taken to be a decode-only step, and the prefill share never falls below what the
  prefill-only rate gives for ``decode_stall`` decode steps. Rules that failed before: counting
  the rest as prefill time shrank every mixed step's prefill to ``min_chunk`` tokens (32-token
  chunks and 10 s TTFT at 2k context, concurrency 4, on the H200); taking the prefill-only rate
  for mixed steps made their slower prefill look like overhead, which raised the next budget,
  a loop that grew mixed steps to the time target (ITL p50 327 ms for dense at 128k,
  concurrency 4); a least-squares line through mixed steps' (cost, seconds) could not split
  the two when the costs barely varied and still reached ~200 ms steps there.
  Each step still carries at least ``min_chunk`` prefill tokens, so every prompt progresses.
"""

from __future__ import annotations

from dataclasses import dataclass

EMA = 0.3  # weight of the newest measurement


def attention_alpha(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    dense_q_heads: list[int]) -> float:
    """Attention FLOPs per (query, key) pair over matmul FLOPs per token, for the whole model.

    Parameters
    ----------
    hidden, intermediate, num_heads, num_kv_heads, head_dim : int
        The model's shape.
    dense_q_heads : list[int]
        Query heads of dense KV heads, per layer (they attend to the whole past).
    """
    per_layer = hidden * head_dim * (2 * num_heads + 2 * num_kv_heads) + 3 * hidden * intermediate
    matmul = 2 * per_layer * len(dense_q_heads)
    attn = 4 * head_dim * sum(dense_q_heads)  # QK^T and PV, 2 FLOPs per multiply-add
    return attn / matmul


@dataclass
class StepBudget:
    """Prefill budget of the next step, learnt from the steps before.

    Parameters
    ----------
    max_tokens : int
        Tokens per step at most (``max_batched_tokens``); a step's cost is capped at
        :attr:`cap`, that of prefilling ``max_tokens`` tokens from an empty cache.
    alpha : float
        :func:`attention_alpha` of the model.
    target_s : float
        Seconds a prefill step should take; 0 turns the time model off.
    decode_stall : float
        With decodes in the step, prefill time at most this multiple of the longer of a
        decode-only step and the rest of such a step.
    min_chunk : int
        Prefill tokens every step may carry, whatever the measurements say.
    """

    max_tokens: int
    alpha: float = 0.0
    target_s: float = 0.0
    decode_stall: float = 1.0
    min_chunk: int = 32
    rate: float | None = None  # token-equivalents per second (prefill-only steps)
    decode_s: float | None = None  # seconds of a decode-only step
    mixed_rate: float | None = None  # token-equivalents per second of prefill next to decodes
    mixed_rest: float | None = None  # seconds of a step that decodes and prefills, beyond its prefill

    @property
    def cap(self) -> float:
        """Token-equivalents a step may carry: a fresh prompt of ``max_tokens`` tokens."""
        return self.cost(self.max_tokens, 0)

    def cost(self, n: int, start: int) -> float:
        """Token-equivalents of prefilling ``n`` tokens after ``start`` cached ones."""
        return n * (1.0 + self.alpha * (start + n / 2))

    def tokens_within(self, budget: float, start: int, remaining: int) -> int:
        """Most tokens (<= ``remaining``) of a prompt at ``start`` whose cost fits ``budget``."""
        if budget <= 0:
            return 0
        if self.alpha <= 0:
            return min(remaining, int(budget))
        # n (1 + a s) + a n^2 / 2 = budget  ->  the positive root
        b = 1.0 + self.alpha * start
        n = min(remaining, int((-b + (b * b + 2 * self.alpha * budget) ** 0.5) / self.alpha))
        # the root in floats can land just below an exact fit (a prompt of max_tokens tokens)
        return n + 1 if n < remaining and self.cost(n + 1, start) <= budget else n

    def prefill_budget(self, n_decode: int) -> float:
        """Token-equivalents of prefill the next step may carry next to ``n_decode`` decodes."""
        cap = self.cap - n_decode
        if self.target_s <= 0:
            return cap
        if self.rate is None:  # nothing measured yet: a small first step to learn from
            return min(cap, 8.0 * self.min_chunk)
        if not n_decode:
            return min(cap, self.rate * self.target_s)
        d = self.decode_s or 0.0
        share = min(self.target_s, self.decode_stall * d) if d > 0 else self.target_s
        if self.mixed_rate is None:  # no such step seen yet: the prefill-only rate
            return min(cap, self.rate * share)
        seconds = min(self.target_s, self.decode_stall * max(d, self.mixed_rest))
        # at least half the prefill-only rate's share: where the parts were not timed apart, an
        # overhead counted as slow prefill must not shrink the next chunks towards nothing
        return min(cap, max(self.mixed_rate * seconds, 0.5 * self.rate * share))

    def observe(self, prefill_cost: float, n_decode: int, seconds: float, prefill_s: float | None = None) -> None:
        """Learn from a finished step: its prefill cost, its decodes, its wall time and, for a step
        that decodes and prefills, the seconds of its prefill part where they were timed apart."""
        if seconds <= 0:
            return
        if prefill_cost <= 0:
            if n_decode:
                self.decode_s = _ema(self.decode_s, seconds)
            return
        if n_decode and self.rate is not None:
            if prefill_s is None:  # one forward: its decodes taken to cost a decode-only step
                prefill_s = seconds - (self.decode_s or 0.0)
            prefill_s = min(seconds, max(prefill_s, 0.1 * seconds))
            self.mixed_rate = _ema(self.mixed_rate, prefill_cost / prefill_s)
            self.mixed_rest = _ema(self.mixed_rest, seconds - prefill_s)
            return
        # A prefill-only step (or the first one seen): it measures the rate. One slow step (a
        # first-time compile) halves the rate at most.
        rate = prefill_cost / max(seconds - (self.decode_s or 0.0) if n_decode else seconds, 0.1 * seconds)
        if self.rate is not None:
            rate = max(rate, self.rate / 2)
        self.rate = _ema(self.rate, rate)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
