"""Test helper: the engine's real scheduler and step budget driven by a simulated GPU.

:class:`SimDevice` says how long a step takes from what it carries; :func:`run` plays requests
through :class:`~lserve.engine.scheduler.Scheduler` (a real KV cache on the ``meta`` device, so
no memory is used) step by step, feeding each step's time back to the
:class:`~lserve.engine.step_budget.StepBudget` as ``LLMEngine.step`` does, and returns when
every request got its first token and when it finished.

:data:`H200_LSERVE` and :data:`H200_DENSE` are llama3-8b at 128k context on the H200, fitted to
the measurements in ``benchmarks/serve/serve_notes.md`` and issue 40:

* prefill-only steps: the engine's one-step TTFT of a 131072-token prompt (7.15 s LServe,
  12.63 s dense) gives the rate in token-equivalents per second;
* decode-only steps (CUDA-graph replays): ITL at 128k, concurrency 1, 4.9 ms (LServe; its
  selected budget keeps a step nearly flat in the batch) and 9.0 ms (dense, whose KV reads grow
  by ~3.6 ms per 128k sequence);
* a step that decodes and prefills: the decode part, then the prefill chunk, run eagerly through
  flash (1.5x slower than a prefill-only step's cuDNN chunks), after ``launch_s`` of planning
  and launching that the GPU waits for (inside the part the engine times with CUDA events), and
  ``host_s`` of scheduling and sampling per step. With the budget rule of session 16
  (``decode_stall`` 4) these give what the H200 did at 128k, concurrency 4, with 2048 output
  tokens: ~65-70 ms steps carrying ~250-300 prompt tokens (1441 mixed steps in 100 s), no
  request finished within 100 s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lserve.cache.kv_cache import KVCache
from lserve.config import CacheConfig
from lserve.engine.sampling import SamplingParams
from lserve.engine.scheduler import ChunkRule, Scheduler
from lserve.engine.sequence import Sequence
from lserve.engine.step_budget import StepBudget, attention_alpha
from lserve.models.presets import preset_config

CONTEXT = 131072


@dataclass(frozen=True)
class SimDevice:
    """Seconds of an engine step from what it carries.

    Parameters
    ----------
    alpha : float
        The model's :func:`~lserve.engine.step_budget.attention_alpha`.
    rate : float
        Token-equivalents per second of a prefill-only step.
    mixed_slowdown : float
        Prefill next to decodes is this much slower per token-equivalent.
    launch_s : float
        Fixed seconds of a prefill part next to decodes (timed with it).
    host_s : float
        Seconds of every step beyond its forwards.
    decode_s, decode_per_seq_s : float
        A decode part's seconds at batch 1, and per further sequence.
    """

    alpha: float
    rate: float
    mixed_slowdown: float
    launch_s: float
    host_s: float
    decode_s: float
    decode_per_seq_s: float

    def step(self, prefill_cost: float, n_decode: int) -> tuple[float, float | None]:
        """(wall seconds, seconds of the prefill part where the engine times it apart, else None)."""
        dec = self.decode_s + self.decode_per_seq_s * (n_decode - 1) if n_decode else 0.0
        if not prefill_cost:  # chained decode steps: their host work hides behind the GPU's
            return dec, None
        if not n_decode:
            return self.host_s + max(self.launch_s, prefill_cost / self.rate), None
        prefill_s = self.launch_s + prefill_cost * self.mixed_slowdown / self.rate
        return self.host_s + dec + prefill_s, prefill_s

    def one_step_prefill_s(self, n: int) -> float:
        """Seconds of a prompt of ``n`` tokens prefilled in one step (the engine's own TTFT)."""
        return n * (1.0 + self.alpha * n / 2) / self.rate


def _device(dense_q_heads: int, ttft_128k_s: float, decode_s: float, decode_per_seq_s: float,
            launch_s: float) -> SimDevice:
    alpha = attention_alpha(4096, 14336, 32, 8, 128, [dense_q_heads] * 32)
    rate = CONTEXT * (1.0 + alpha * CONTEXT / 2) / ttft_128k_s
    return SimDevice(alpha, rate, 1.5, launch_s, 0.008, decode_s, decode_per_seq_s)


H200_LSERVE = _device(16, 7.15, 0.0049, 0.0004, 0.033)
H200_DENSE = _device(32, 12.63, 0.0090, 0.0036, 0.045)


class NoText:
    def decode(self, ids) -> str:
        return ""


@dataclass
class Outcome:
    """What :func:`run` measured, in simulated seconds, per request (index order)."""

    ttft: list[float | None]
    finish: list[float | None]
    itl_max: list[float]  # each request's worst gap between tokens
    steps: list[tuple[float, int, int]] = field(default_factory=list)  # (seconds, decodes, prefill tokens)

    @property
    def makespan(self) -> float | None:
        return None if None in self.finish else max(self.finish)


@dataclass(frozen=True)
class SparsePrefill:
    """Every prompt prefilled block-sparse: chunks on a ``row``-token grid that compute ``kept`` of
    their causal tiles (and the estimate's ``estimate`` share of dense attention on top). The engine
    reports ``kept`` to the budget after each such step (``observe``; False: the rule before, which
    costed them as dense)."""

    kept: float
    estimate: float
    row: int = 2048
    observe: bool = True

    def cost(self, alpha: float, chunks: list[tuple[int, int]]) -> float:
        """What the chunks ((start, tokens)) cost the device, in token-equivalents."""
        a = alpha * min(1.0, self.kept + self.estimate)
        return sum(n * (1.0 + a * (s + n / 2)) for s, n in chunks)


def run(device: SimDevice, budget: StepBudget, requests: list[tuple[float, int, int]], max_num_seqs: int = 4,
        until_s: float = 600.0, sparse: SparsePrefill | None = None) -> Outcome:
    """Play ``requests`` ((arrival s, prompt tokens, output tokens)) through a scheduler with
    ``budget`` on ``device``, until all finished or ``until_s`` simulated seconds passed."""
    need = sum(p + o + 64 for _, p, o in requests)
    cache = KVCache(preset_config("tiny"), CacheConfig(dense_pool_tokens=need), [1] * 4, 64, 256, max_num_seqs,
                    torch.float32, "meta")
    rule = (lambda seq, decoding: ChunkRule(sparse.row, sparse=True)) if sparse else None
    sched = Scheduler(cache, max_num_seqs, budget, lambda seq_id: None, rule)
    seqs = [Sequence(i, f"r{i}", [1 + (i + j) % 400 for j in range(p)],
                     SamplingParams(max_tokens=o, temperature=0, ignore_eos=True, prefix_cache=False), arrival=a)
            for i, (a, p, o) in enumerate(requests)]
    out = Outcome([None] * len(seqs), [None] * len(seqs), [0.0] * len(seqs))
    last_token = [0.0] * len(seqs)
    t, queued = 0.0, 0
    tok = NoText()
    while t < until_s:
        while queued < len(seqs) and seqs[queued].arrival <= t:
            sched.add(seqs[queued])
            queued += 1
        if not sched.has_work():
            if queued == len(seqs):
                break
            t = seqs[queued].arrival
            continue
        batch = sched.schedule()
        cost = sched.last_prefill_cost
        n_decode = sum(1 for b in batch if b.decode)
        chunks = [(b.seq.num_computed, b.num_tokens) for b in batch if not b.decode]
        seconds, prefill_s = device.step(sparse.cost(device.alpha, chunks) if sparse else cost, n_decode)
        budget.observe(cost, n_decode, seconds, prefill_s)
        if sparse and sparse.observe and chunks:
            budget.observe_sparse(sparse.kept)
        t += seconds
        out.steps.append((seconds, n_decode, sum(b.num_tokens for b in batch if not b.decode)))
        for item in batch:
            seq = item.seq
            seq.num_computed += item.num_tokens
            if seq.num_computed < seq.num_tokens:
                continue
            i = seq.seq_id
            seq.in_decode = True
            seq.append_token(7, tok, (), 10**9)
            if out.ttft[i] is None:
                out.ttft[i] = t - seq.arrival
            else:
                out.itl_max[i] = max(out.itl_max[i], t - last_token[i])
            last_token[i] = t
            if seq.finish_reason is not None:
                out.finish[i] = t
                sched.finish(seq)
    return out
