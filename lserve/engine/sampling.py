"""Sampling parameters (validated) and the sampler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lserve.config import ConfigError


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Parameters
    ----------
    temperature : float
        0 means greedy.
    top_k : int
        0 or -1 disables.
    stop : list[str]
        Strings that end generation; they are not included in the output text.
    token_budget : int or None
        Per-request override of the dense heads' decode token budget (0 disables selection).
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and self.top_k >= -1, f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (self.token_budget is None or self.token_budget >= 0, f"token_budget must be >= 0, got {self.token_budget}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token from float32 logits [V]."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits / params.temperature
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
