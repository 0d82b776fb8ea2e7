"""Test helper: record the logits an engine's forward returns (the reference for logprob checks)."""

from __future__ import annotations

import weakref

import torch


def capture_logits(engine) -> list[torch.Tensor]:
    """Wrap ``engine.model.forward`` so that it keeps a copy of every logits tensor it returns.

    Returns the list the copies are appended to; ``del engine.model.forward`` restores the method.
    """
    seen: list[torch.Tensor] = []
    # weakly: the model holds `wrapped`, so a strong reference to its bound method would be a cycle
    # that keeps the model's weights alive after the test, until the cyclic GC happens to run
    fwd = weakref.WeakMethod(engine.model.forward)

    def wrapped(*a, **k):
        out = fwd()(*a, **k)
        seen.append(out.clone())
        return out

    engine.model.forward = wrapped
    return seen
