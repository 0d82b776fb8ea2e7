"""The attention backend interface: ``plan`` once per step, ``run`` once per layer.

``plan(steps)`` is host-side work (index tables, selection schedule); ``run(layer, q, k, v,
plan)`` writes the layer's new K/V into the two-way cache and returns attention output. The
torch backend is the reference every other backend is tested against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from lserve.cache.kv_cache import KVCache
from lserve.config import ModelConfig, SparsityConfig
from lserve.sparsity.layer_select import resolve_select_layers
from lserve.sparsity.plan import SeqStep, StepPlan, StepPlanner


@dataclass
class SelectorStats:
    """Running totals of dynamic page selection (exported as metrics).

    ``runs``: selector invocations (one per layer and sequence); ``reuses``: layer-steps that
    reused a stored selection; ``pages``: physical pages kept by the runs; ``seconds``: host
    time spent in the selector (device time on GPU backends that sync, else launch time).
    """

    runs: int = 0
    reuses: int = 0
    pages: int = 0
    seconds: float = 0.0


class AttentionBackend(ABC):
    """Block-sparse attention over the two-way paged cache.

    Parameters
    ----------
    model : ModelConfig
    sparsity : SparsityConfig
    cache : KVCache
        Heads already permuted: per layer, KV heads ``[0, cache.n_dense[layer])`` are dense.
    """

    name = "base"

    def __init__(self, model: ModelConfig, sparsity: SparsityConfig, cache: KVCache) -> None:
        self.model, self.sp, self.cache = model, sparsity, cache
        self.group = model.group_size
        self.scale = model.head_dim ** -0.5
        device = cache.dense[0].k.device
        self.planner = StepPlanner(sparsity, cache, device)
        self.selector_stats = SelectorStats()
        # One flag per layer from ``select_layers`` (raises ConfigError on a layer-count mismatch).
        self.select_layers = resolve_select_layers(sparsity.select_layers, model)
        # No layer selects: plan every decode step as below the threshold (no selector state).
        self.planner.selects = any(self.layer_selects(i) for i in range(model.num_layers))

    def plan(self, steps: list[SeqStep], host: bool = False) -> StepPlan:
        """Host-side metadata for one forward step (``host``: its tensors stay on the CPU)."""
        return self.planner.plan(steps, host)

    def release(self, seq_id: int) -> None:
        """Drop per-sequence state (selection reuse) of a finished/aborted/preempted sequence."""
        self.planner.release(seq_id)

    def layer_selects(self, layer: int) -> bool:
        """Dynamic selection applies to this layer (not forced dense, in ``select_layers``, has
        dense heads)."""
        return layer >= self.sp.dense_layers and self.select_layers[layer] and self.cache.n_dense[layer] > 0

    @abstractmethod
    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Attention of one layer.

        q: [T, H_q, D], k, v: [T, H_kv, D] (RoPE applied) -> [T, H_q, D].
        """
