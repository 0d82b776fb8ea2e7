"""Sampling parameters (validated), the sampler, and the batched logit processing behind
penalties, ``logit_bias``, ``min_tokens`` and logprobs.

Logprobs are vLLM's default "raw logprobs": ``log_softmax`` of the model's logits as the forward
returned them, before ``min_tokens``, ``logit_bias``, penalties, temperature and top-k/top-p
(vLLM V1's ``logprobs_mode="raw_logprobs"``). They describe the model's distribution, so they do
not depend on how the token was picked (and a greedy token's logprob is the top one).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from lserve.engine.request_check import RequestCheck

PROMPT_LOGPROB_BLOCK = 256  # prompt rows turned into [rows, V] logits at a time (bounds the memory)

# A token's logprob entry: (token id, logprob, ((alternative id, logprob), ...) best first).
TokenLogprob = tuple[int, float, tuple[tuple[int, float], ...]]

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (as vLLM does)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (checked when made: :meth:`RequestCheck.params`,
    which raises :class:`~lserve.engine.request_check.RequestError` naming the field).

    Parameters
    ----------
    max_tokens : int
        At least 1; 0 only with ``prompt_logprobs`` (score the prompt, generate nothing).
    temperature : float
        0 means greedy.
    top_k : int
        0 or -1 disables.
    stop : list[str]
        Strings that end generation; they are not included in the output text.
    token_budget : int or None
        Per-request override of the dense heads' decode token budget (0 disables selection).
    prefill_sparsity : float or None
        Per-request override of ``SparsityConfig.prefill_sparsity`` (block-sparse prefill's kept
        estimated mass, in [0, 1]; 0 off).
    min_tokens : int
        EOS (unless ``ignore_eos``) and ``stop_token_ids`` cannot be sampled, and stop strings do
        not end the request, before this many tokens were generated.
    presence_penalty, frequency_penalty : float
        OpenAI's penalties over the generated tokens: ``logit -= frequency * count + presence *
        (count > 0)``, in [-2, 2].
    repetition_penalty : float
        vLLM's (CTRL's) penalty over prompt and generated tokens: a seen token's positive logit is
        divided by it, a negative one multiplied; 1 is off.
    logit_bias : dict[int, float] or None
        Added to the logits of these token ids, each in [-100, 100].
    logprobs : int or None
        Record each generated token's logprob and this many top alternatives (0..20).
    prompt_logprobs : int or None
        Record each prompt token's logprob (the first is None) and this many top alternatives.
    prefix_cache : bool
        False: this request neither reuses cached prompt pages nor leaves its own in the engine's
        prefix cache (prompt logprobs also skip reuse: cached tokens are not scored).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    token_budget: int | None = None
    prefill_sparsity: float | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        RequestCheck.params(self)
        if self.logit_bias:  # JSON object keys arrive as strings
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        # vLLM's rule: below this, logits / temperature overflows to inf (NaN probabilities)
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Penalties or a bias change this request's logits at every step."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


def needs_processing(seq) -> bool:
    """Whether ``seq``'s next token comes from changed logits (penalties, bias, ``min_tokens`` not
    reached yet). Rows that do not keep the plain fast path (no copy of their logits)."""
    p = seq.params
    return p.penalized or len(seq.output_ids) < p.min_tokens


def process_logits(logits: torch.Tensor, seqs: Seq, eos_ids: Seq[int]) -> torch.Tensor:
    """Apply ``min_tokens``, ``logit_bias`` and the penalties, in vLLM's order, to the rows of
    ``seqs`` (one row each).

    Parameters
    ----------
    logits : torch.Tensor
        float32 [R, V], a copy owned by the caller (row r belongs to ``seqs[r]``).
    seqs : sequence of Sequence
        Uses ``params``, ``output_ids`` (every token is real: these rows are never chained) and
        ``prompt_token_mask``.
    eos_ids : sequence of int

    Returns
    -------
    torch.Tensor
        The changed logits (``logits`` itself or a new tensor). Every step builds small per-row
        index/value tensors; a row with neutral settings is left as it was.
    """
    R, V = logits.shape
    dev = logits.device
    _mask_stops(logits, seqs, eos_ids)
    _add_bias(logits, seqs)
    rep = [s.params.repetition_penalty for s in seqs]
    freq = [s.params.frequency_penalty for s in seqs]
    pres = [s.params.presence_penalty for s in seqs]
    if all(r == 1.0 for r in rep) and not any(freq) and not any(pres):
        return logits
    counts = _output_counts(seqs, V, dev)  # float32 [R, V]: each token's count in the generated text
    if any(r != 1.0 for r in rep):
        seen = counts > 0  # bool [R, V]
        for r, s in enumerate(seqs):
            if rep[r] != 1.0:
                seen[r] |= s.prompt_token_mask(V, dev)
        rep_t = torch.tensor(rep, dtype=logits.dtype, device=dev)[:, None]  # [R, 1]
        penalized = torch.where(logits > 0, logits / rep_t, logits * rep_t)
        logits = torch.where(seen, penalized, logits)
    if any(freq) or any(pres):
        freq_t = torch.tensor(freq, dtype=logits.dtype, device=dev)[:, None]  # [R, 1]
        pres_t = torch.tensor(pres, dtype=logits.dtype, device=dev)[:, None]
        logits -= freq_t * counts + pres_t * (counts > 0).to(logits.dtype)
    return logits


def _mask_stops(logits: torch.Tensor, seqs: Seq, eos_ids: Seq[int]) -> None:
    """``min_tokens``: EOS and stop token ids get -inf until enough tokens were generated."""
    rows, cols = [], []
    for r, s in enumerate(seqs):
        p = s.params
        if len(s.output_ids) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            banned = [t for t in banned if 0 <= t < logits.shape[1]]
            rows += [r] * len(banned)
            cols += banned
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")


def _add_bias(logits: torch.Tensor, seqs: Seq) -> None:
    rows, cols, vals = [], [], []
    for r, s in enumerate(seqs):
        for tok, b in (s.params.logit_bias or {}).items():
            rows.append(r)
            cols.append(tok)
            vals.append(b)
    if rows:
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)


def _output_counts(seqs: Seq, V: int, dev) -> torch.Tensor:
    """float32 [R, V]: how often each token occurs in each row's generated tokens."""
    counts = torch.zeros(len(seqs), V, dtype=torch.float32, device=dev)
    rows = [r for r, s in enumerate(seqs) for _ in s.output_ids]
    if rows:
        toks = [t for s in seqs for t in s.output_ids]
        counts.index_put_((torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)),
                          torch.ones(len(rows), device=dev), accumulate=True)
    return counts


# -- logprobs -----------------------------------------------------------------------------------
@dataclass
class PromptLogprobChunk:
    """Prompt logprobs of one prefill chunk, on the device until the step is read.

    ``logprobs[i]`` (float32 [E]) is the logprob of prompt token ``first + i`` and ``top_values``
    / ``top_ids`` ([E, k]) its best alternatives.
    """

    seq: object
    first: int
    logprobs: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def entries(self) -> list[TokenLogprob]:
        ids = self.seq.prompt_ids[self.first: self.first + self.logprobs.numel()]
        return _entries(ids, self.logprobs.tolist(), self.top_values.tolist(), self.top_ids.tolist(),
                        self.seq.params.prompt_logprobs)


def prompt_logprob_chunk(seq, first: int, hidden: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor],
                         block: int = PROMPT_LOGPROB_BLOCK) -> PromptLogprobChunk:
    """Logprobs of prompt tokens ``first .. first + E - 1`` from the final hidden states of the
    positions before them (``hidden`` [E, H]); ``logits_fn`` is the LM head ([e, H] -> float32
    [e, V]), run ``block`` rows at a time."""
    k = seq.params.prompt_logprobs
    targets = torch.tensor(seq.prompt_ids[first: first + hidden.shape[0]], dtype=torch.long, device=hidden.device)
    lps, vals, ids = [], [], []
    for lo in range(0, hidden.shape[0], block):
        lp = torch.log_softmax(logits_fn(hidden[lo: lo + block]), dim=-1)  # float32 [e, V]
        lps.append(lp.gather(1, targets[lo: lo + block, None])[:, 0])
        top = lp.topk(k, dim=-1)
        vals.append(top.values)
        ids.append(top.indices)
    return PromptLogprobChunk(seq, first, torch.cat(lps), torch.cat(vals), torch.cat(ids))


@dataclass
class SampleLogprobs:
    """Raw logprobs of the sampler rows that asked for them (device tensors until read).

    ``rows`` are sampler rows and ``ks`` how many alternatives each asked for; ``logprobs``
    float32 [len(rows), V]; ``top_values``/``top_ids`` [len(rows), max(ks)].
    """

    rows: list[int]
    ks: list[int]
    logprobs: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, rows: list[int], ks: list[int]) -> SampleLogprobs:
        """From the raw logits [nb, V] of a step, before any processing."""
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)  # [R, V]
        top = lp.topk(max(ks), dim=-1)
        return cls(rows, ks, lp, top.values, top.indices)

    def entries(self, tokens: list[int]) -> dict[int, TokenLogprob]:
        """Sampler row -> entry, for the tokens picked in each of :attr:`rows` (one device read)."""
        tok = torch.tensor(tokens, dtype=torch.long, device=self.logprobs.device)
        chosen = self.logprobs.gather(1, tok[:, None])[:, 0].tolist()
        got = _entries(tokens, chosen, self.top_values.tolist(), self.top_ids.tolist(), self.ks)
        return dict(zip(self.rows, got))


@dataclass
class StepExtras:
    """What a launched step computed beyond tokens: raw logprobs of its sampler rows that asked
    for them, and prompt logprobs of its prefill chunks that asked for them. A step with extras
    is never chained (async decode), so its sequences' tokens are all real."""

    sample_logprobs: SampleLogprobs | None
    prompt_chunks: list[PromptLogprobChunk]


def _entries(ids, lps, vals, tops, ks) -> list[TokenLogprob]:
    ks = [ks] * len(ids) if isinstance(ks, int) else ks
    return [(int(t), float(lp), tuple(zip(ti[:k], v[:k]))) for t, lp, v, ti, k in zip(ids, lps, vals, tops, ks)]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token from float32 logits [V]."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits / params.temperature
    top = x == float("inf")  # a tiny repetition_penalty (5e-324) divides a seen token's logit to inf
    if top.any():  # those tokens hold all the mass (softmax of inf would be NaN): draw among them
        x = torch.zeros_like(x).masked_fill_(~top, float("-inf"))
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token once the mass before it already reaches top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[0] = False  # the most likely token always stays, however small top_p rounds
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
