"""How long a host-tier bench run should take, so that ``--deadline`` skips runs that cannot finish.

A prompt of ``L`` tokens is prefilled in the chunks the engine's scheduler would cut
(:func:`prefill_chunks`: with the tier on, ``max_batched_tokens`` tokens at any depth; all on the
GPU, chunks that shrink with depth under the attention-aware cost of
:class:`~lserve.engine.step_budget.StepBudget`). A chunk of ``n`` tokens after ``s`` cached ones costs

* the weight GEMMs, ``GEMM_S_PER_TOKEN * n``;
* the dense heads' attention, ``ATTN_OVER_GEMM * alpha * kept * n * (s + n / 2)`` times the same
  rate (``alpha``: :func:`~lserve.engine.step_budget.attention_alpha`; ``kept``: the share of causal
  tiles block-sparse prefill keeps, plus its estimate's share,
  :func:`~lserve.sparsity.prefill_blocks.estimate_share`); all-GPU chunks of a block-sparse prefill
  are cut at that share, as the engine's step budget costs them once it has measured it;
* a fixed cost per chunk (planning, launches, the kernels a chunk does not fill), per mode;
* with the tier, its past beyond the resident set read from the host, at ``H2D_BYTES_PER_S``.

The constants come from the H200 rows of 2026-12-04 (``benchmarks/host_tier/host_tier_h200.log``,
llama3-8b, INT4 KV, 128k): GEMMs 3.0 s per 128k tokens; SDPA on the dense heads at 256k 0.544 s
per layer (so attention runs at ~1.18x the GEMMs' time per token-equivalent); chunk costs fitted to
the per-chunk times of that log (tier 16 chunks in 9.5 s, all-GPU 36 in 12.1 s: the model gives 8.7
and 12.8 s). The read rate is a low guess (those chunks' reads hide in their noise). Once a run
of a mode is measured, later runs of that mode are scaled by its measured/modelled ratio.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lserve.engine.scheduler import aligned_chunk
from lserve.engine.step_budget import StepBudget

GEMM_S_PER_TOKEN = 3.0 / 131072
ATTN_OVER_GEMM = 1.18
CHUNK_S = {"tier": 0.05, "gpu": 0.15}
H2D_BYTES_PER_S = 10e9
SETUP_S = 5.0
SETUP_S_PER_HOST_GIB = 0.3  # pinning host memory
# kept share of causal tiles per unit of tau before one is measured (tau 0.2 kept 0.237 at 128k
# on the H200 with random weights, benchmarks/e2e)
KEPT_PER_TAU = 1.2
# decode ms/token at 128k before a row is measured (the 2026-12-04 rows)
DECODE_MS_128K = {"tier": 6.07, "gpu": 4.86}


def prefill_chunks(context: int, max_batched_tokens: int, alpha: float, align: int = 2048,
                   n_decode: int = 0) -> list[tuple[int, int]]:
    """(start, tokens) of each chunk of a ``context``-token prompt as the scheduler cuts it in steps
    that also carry ``n_decode`` decodes (``alpha`` 0: the tier's fixed chunks), chunk ends on the
    ``align`` grid (:func:`~lserve.engine.scheduler.aligned_chunk`)."""
    budget = StepBudget(max_batched_tokens, alpha)
    room, left = budget.cap - n_decode, max_batched_tokens - n_decode
    out, s = [], 0
    while s < context:
        remaining = context - s
        n = max(min(budget.tokens_within(room, s, remaining), left), min(budget.min_chunk, remaining, left))
        if align and n < remaining:
            n = aligned_chunk(s, n, remaining, left, align)
        out.append((s, n))
        s += n
    return out


@dataclass
class TimeModel:
    """The prefill/decode time model of one model shape (module docstring).

    Parameters
    ----------
    alpha : float
        :func:`~lserve.engine.step_budget.attention_alpha` of the model and head layout.
    host_bytes_per_token : float
        Host bytes a token of dense-head KV takes (all layers).
    max_batched_tokens : int
        The engine's token cap per step.
    """

    alpha: float
    host_bytes_per_token: float
    max_batched_tokens: int = 8192
    estimate: float = 1 / 32  # the block-sparse estimate's share (estimate_share)
    chunk_s: dict = field(default_factory=lambda: dict(CHUNK_S))

    def kept(self, tau: float) -> float:
        """Share of the dense attention's cost block-sparse prefill at ``tau`` leaves (before any is measured)."""
        return 1.0 if tau <= 0 else min(1.0, KEPT_PER_TAU * tau + self.estimate)

    def row_kept(self, row: dict) -> float:
        """:meth:`kept` of a measured row: its kept fraction where the engine reported one."""
        tau, measured = row.get("prefill_sparsity", 0.0), row.get("prefill_kept_fraction")
        return self.kept(tau) if tau <= 0 or measured is None else min(1.0, measured + self.estimate)

    def prefill_s(self, run: dict, kept: float = 1.0, n_decode: int = 0) -> float:
        """Modelled seconds of the run's prefill (``run``: mode, context, resident_tokens)."""
        tier = run["mode"] == "tier"
        chunks = prefill_chunks(run["context"], self.max_batched_tokens, 0.0 if tier else self.alpha * kept,
                                n_decode=n_decode)
        pairs = sum(n * (s + n / 2) for s, n in chunks)
        t = GEMM_S_PER_TOKEN * (run["context"] + ATTN_OVER_GEMM * self.alpha * kept * pairs)
        t += self.chunk_s[run["mode"]] * len(chunks)
        if tier:
            read = sum(max(0, s + n - run["resident_tokens"]) for s, n in chunks)
            t += read * self.host_bytes_per_token / H2D_BYTES_PER_S
        return t

    def estimate_s(self, run: dict, rows: list[dict], decode_steps: int) -> float:
        """Seconds ``run`` should take: set-up, its prefill (scaled by the measured/modelled ratio of
        the longest measured row of its mode, with that row's kept fraction where its tau is the
        same) and its decode steps (the ms/token of that row, else of the prior, grown with the
        context)."""
        tau = run.get("prefill_sparsity", 0.0)
        done = [r for r in rows if r["mode"] == run["mode"] and not r.get("cut") and "ttft_s" in r]
        ref = max(done, key=lambda r: r["context"], default=None)
        kept = self.kept(tau)
        scale, ms, c0 = 1.0, DECODE_MS_128K[run["mode"]], 131072
        if ref is not None:
            ref_kept = self.row_kept(ref)
            if ref.get("prefill_sparsity", 0.0) == tau:
                kept = ref_kept
            scale = ref["ttft_s"] / self.prefill_s(ref, ref_kept)
            ms, c0 = ref["decode_ms_per_token"], ref["context"]
        setup = SETUP_S + SETUP_S_PER_HOST_GIB * run.get("host_kv_gib", 0.0)
        return setup + scale * self.prefill_s(run, kept) + decode_steps * ms * max(1.0, run["context"] / c0) / 1e3
