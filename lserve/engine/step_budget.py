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
* A chunk of a sequence whose prefill is block-sparse (issue 35) attends to a share of its past:
  its attention term is scaled by :attr:`StepBudget.sparse_share`, the share of the dense heads'
  causal tiles such chunks computed lately (learnt from every step that ran them, layers that ran
  dense counted whole), plus the estimate's own score products (``estimate_share``). Counted as
  dense, the chunks of a 128k prompt keeping ~24% looked ~2.3x as costly as they were at its end,
  so the time model learnt a rate that sized every other chunk ~2x too large: steps with decodes
  at 222 ms against the 100 ms SLO on the H200 (``benchmarks/serve/serve_h200_itl_sweep.json``).
* Without a time target (``step_time_target = 0``, the engine's default) a step carries at most
  ``max_batched_tokens`` tokens and at most the cost of prefilling that many from an empty cache
  (decodes included, deterministically): a prompt of ``max_batched_tokens`` tokens is one step,
  as in vLLM, and chunks deeper into a longer prompt carry fewer tokens for the same cost.
* With the host KV tier on (and no time target) chunks carry ``max_batched_tokens`` tokens at any
  depth: each chunk re-reads its offloaded past from the host (:meth:`StepBudget.for_engine`).
* With one (``lserve serve``'s default), or with an ITL SLO, the budget follows measured speed.
  A step is modelled as ``overhead + cost / rate``: ``rate`` (token-equivalents per second) is
  learnt from steps that only prefill, times the target gives their budget. A step that also
  decodes is timed in two parts where the engine can (CUDA events around its prefill forward,
  which runs after the decodes' graph replay): its prefill's own rate (``mixed_rate``, which
  differs from a prefill-only step's: on the H200 a long prompt's chunks next to decodes run
  flash, its grid-aligned prefill-only chunks cuDNN, ~1.5x faster), and the rest of the step
  (``mixed_rest``: decodes, scheduling, sampling). Where the parts cannot be timed apart (one
  eager forward, e.g. on a CPU) the rest is taken to be a decode-only step.

**The rule for a step that carries decodes** (:meth:`StepBudget.prefill_budget`, the one place
it lives): such a step should take at most ``itl_slo_s`` (``--itl-slo-ms``; without one,
``target_s``). Its prefill gets the seconds that leave after the rest of the step, aimed at 0.9 of
the limit (a margin for the averages' noise), at ``mixed_rate``: ``mixed_rate * (0.9 * limit -
rest)`` token-equivalents, *but never less than* ``floor_cost``. That floor is learnt so that such
steps spend at least ``min_prefill_share`` of their wall time on prefill *counted at the
prefill-only rate*: a step that spent less raises it at once (up to 2x a step), one that spent
more lowers it slowly. Counting at the prefill-only rate makes the floor see every loss of a
small chunk (the fixed cost of planning and launching it, a GPU that small chunks do not fill,
slower kernels next to decodes), not only the decodes' time. So while the decodes and a chunk's
fixed costs leave room, the steps that carry decodes stay within the SLO; where they do not (a
long past, many decodes), the SLO gives way and a waiting prompt still gets ``share`` of the
GPU: its TTFT is at most about its prefill time alone over ``share`` (3.3x at the default 0.3),
whatever else runs. Each step also carries at least ``min_chunk`` prefill tokens.

Rules that failed before: counting the rest as prefill time shrank every mixed step's prefill to
``min_chunk`` tokens (32-token chunks and 10 s TTFT at 2k context, concurrency 4, on the H200);
taking the prefill-only rate for mixed steps made their slower prefill look like overhead, which
raised the next budget, a loop that grew mixed steps to the time target (ITL p50 327 ms for dense
at 128k, concurrency 4); a least-squares line through mixed steps' (cost, seconds) could not split
the two when the costs barely varied and still reached ~200 ms steps there; sizing the prefill as
``decode_stall`` (4) times the rest of a step starved prefill at long contexts (issue 40): at 128k,
concurrency 4, the rest was ~14 ms, so the prefill got ~55 ms, of which a fixed ~33 ms (planning and
launching a chunk, in a fit of the measurements: ``tests/sim_device.py``) did no prefill, and
~250-token chunks in 65 ms steps prefilled at a fifth of the one-step rate (no request of 4
finished in 100 s).
"""

from __future__ import annotations

from dataclasses import dataclass

from lserve.sparsity.prefill_blocks import estimate_share

EMA = 0.3  # weight of the newest measurement
# steps that carry decodes aim at this fraction of their limit: the budget predicts them from
# averages, and the limit is an SLO on the tail
SLO_AIM = 0.9


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
    max_batched_tokens : int
        Tokens per step at most (:attr:`~lserve.config.EngineConfig.max_batched_tokens`); a step's
        cost is capped at :attr:`cap`, that of prefilling that many tokens from an empty cache.
    alpha : float
        :func:`attention_alpha` of the model.
    target_s : float
        Seconds a prefill-only step should take; 0: ``max_batched_tokens`` alone sizes them.
    itl_slo_s : float
        Seconds a step that carries decodes should take at most (0: ``target_s``); the time
        model is on when either is set (:attr:`timed`).
    min_prefill_share : float
        The least fraction of the wall time of steps that carry decodes their prefill gets,
        counted at the prefill-only rate, in (0, 1).
    min_chunk : int
        Prefill tokens every step may carry, whatever the measurements say.
    estimate_share : float
        A block-sparse prefill's estimate, as a share of dense attention's cost
        (:func:`~lserve.sparsity.prefill_blocks.estimate_share`).
    """

    max_batched_tokens: int
    alpha: float = 0.0
    target_s: float = 0.0
    itl_slo_s: float = 0.0
    min_prefill_share: float = 0.3
    min_chunk: int = 32
    estimate_share: float = 0.0
    sparse_kept: float | None = None  # share of causal tiles block-sparse chunks computed (observe_sparse)
    rate: float | None = None  # token-equivalents per second (prefill-only steps)
    decode_s: float | None = None  # seconds of a decode-only step
    mixed_rate: float | None = None  # token-equivalents per second of prefill next to decodes
    mixed_rest: float | None = None  # seconds of a step that decodes and prefills, beyond its prefill
    floor_cost: float = 0.0  # token-equivalents a step with decodes carries at least (_learn_floor)
    offered: float = 0.0  # the budget prefill_budget gave last

    def __post_init__(self) -> None:
        if not 0 < self.min_prefill_share < 1:
            raise ValueError(f"min_prefill_share must be in (0, 1), got {self.min_prefill_share}")
        if self.target_s < 0 or self.itl_slo_s < 0:
            raise ValueError("target_s and itl_slo_s must be >= 0")

    @classmethod
    def for_engine(cls, config, alpha: float) -> StepBudget:
        """The budget an engine with :class:`~lserve.config.EngineConfig` ``config`` schedules with.

        With the host KV tier on and no time model, chunks are bounded by ``max_batched_tokens``
        alone (``alpha`` 0): each chunk reads its past beyond the resident set from the host again,
        so the read grows with the number of chunks (~ (L - R)^2 / (2 * chunk) tokens per layer
        for an L-token prompt and R resident), and chunks that shrink with depth multiply it
        (3.4x at 128k on Llama-3-8B, ~10x at 512k)."""
        if config.cache.host_kv_gib and not (config.step_time_target or config.itl_slo_ms):
            alpha = 0.0
        sp = config.sparsity
        return cls(config.max_batched_tokens, alpha, config.step_time_target, config.itl_slo_ms / 1000.0,
                   config.min_prefill_share, estimate_share=estimate_share(sp.prefill_estimator, sp.prefill_stride))

    @property
    def timed(self) -> bool:
        """Whether budgets follow measured step times (the engine then reports them to :meth:`observe`)."""
        return self.target_s > 0 or self.itl_slo_s > 0

    @property
    def cap(self) -> float:
        """Token-equivalents a step may carry: a fresh prompt of ``max_batched_tokens`` tokens."""
        return self.cost(self.max_batched_tokens, 0)

    @property
    def sparse_share(self) -> float:
        """A block-sparse chunk's attention as a share of a dense one's: what it computes and its estimate."""
        if self.sparse_kept is None:  # nothing measured yet: counted as dense
            return 1.0
        return min(1.0, self.sparse_kept + self.estimate_share)

    def cost(self, n: int, start: int, sparse: bool = False) -> float:
        """Token-equivalents of prefilling ``n`` tokens after ``start`` cached ones (``sparse``: by
        block-sparse prefill)."""
        return n * (1.0 + self._alpha(sparse) * (start + n / 2))

    def tokens_within(self, budget: float, start: int, remaining: int, sparse: bool = False) -> int:
        """Most tokens (<= ``remaining``) of a prompt at ``start`` whose cost fits ``budget``."""
        if budget <= 0:
            return 0
        a = self._alpha(sparse)
        if a <= 0:
            return min(remaining, int(budget))
        # n (1 + a s) + a n^2 / 2 = budget  ->  the positive root
        b = 1.0 + a * start
        n = min(remaining, int((-b + (b * b + 2 * a * budget) ** 0.5) / a))
        # the root in floats can land just below an exact fit (a prompt of max_batched_tokens tokens)
        return n + 1 if n < remaining and self.cost(n + 1, start, sparse) <= budget else n

    def _alpha(self, sparse: bool) -> float:
        return self.alpha * self.sparse_share if sparse else self.alpha

    def learnt(self) -> dict:
        """What the measurements have taught the budget so far (None: not measured yet)."""
        return {"rate": self.rate, "decode_s": self.decode_s, "mixed_rate": self.mixed_rate,
                "mixed_rest_s": self.mixed_rest, "floor_cost": self.floor_cost, "sparse_share": self.sparse_share}

    def observe_sparse(self, kept: float) -> None:
        """Learn from a step's block-sparse chunks: the share of their causal tiles they computed."""
        self.sparse_kept = _ema(self.sparse_kept, min(max(kept, 0.0), 1.0))

    def mixed_prefill_s(self) -> float:
        """Seconds of prefill the ITL SLO (else the step target), aimed at with a margin, leaves a
        step that carries decodes after the rest of such a step (the module docstring's rule)."""
        rest = self.mixed_rest if self.mixed_rest is not None else (self.decode_s or 0.0)
        return max(SLO_AIM * (self.itl_slo_s or self.target_s) - rest, 0.0)

    def prefill_budget(self, n_decode: int) -> float:
        """Token-equivalents of prefill the next step may carry next to ``n_decode`` decodes."""
        cap = self.cap - n_decode
        if not self.timed or (not n_decode and self.target_s <= 0):
            room = cap
        elif self.rate is None:  # nothing measured yet: a small first step to learn from
            room = min(cap, 8.0 * self.min_chunk)
        elif not n_decode:
            room = min(cap, self.rate * self.target_s)
        else:  # no such step seen yet: half the prefill-only rate (chunks next to decodes run slower)
            room = min(cap, max((self.mixed_rate or 0.5 * self.rate) * self.mixed_prefill_s(), self.floor_cost))
        self.offered = room
        return room

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
            if prefill_cost >= 0.5 * self.offered:  # the step had prompt work for its budget
                self._learn_floor(prefill_cost, seconds)
            return
        # A prefill-only step (or the first one seen): it measures the rate. One slow step (a
        # first-time compile) halves the rate at most.
        rate = prefill_cost / max(seconds - (self.decode_s or 0.0) if n_decode else seconds, 0.1 * seconds)
        if self.rate is not None:
            rate = max(rate, self.rate / 2)
        self.rate = _ema(self.rate, rate)

    def _learn_floor(self, prefill_cost: float, seconds: float) -> None:
        """Move :attr:`floor_cost` towards the prefill that makes a step carrying decodes spend
        ``min_prefill_share`` of its time prefilling at the prefill-only rate: up at once where
        this step spent less (a fixed cost per chunk makes small chunks waste the step), down
        slowly where it spent more."""
        share = prefill_cost / self.rate / seconds
        want = prefill_cost * min(max(self.min_prefill_share / share, 0.5), 2.0)
        self.floor_cost = want if want > self.floor_cost else _ema(self.floor_cost, want)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
