"""The attention backend interface: ``plan`` once per step, ``run`` once per layer.

``plan(steps)`` does the step's host-side work (index tables, selection schedule, a backend's
own tables in :attr:`~lserve.sparsity.plan.StepPlan.tables`) and returns the one object every
layer reads; ``run(layer, q, k, v, plan)`` writes the layer's new K/V into the two-way cache and
returns attention output, building nothing. The torch backend is the reference every other
backend is tested against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from lserve.cache.host_tier import SeqSpan
from lserve.cache.kv_cache import KVCache
from lserve.config import ConfigError, ModelConfig, SparsityConfig
from lserve.sparsity.adaptive_budget import layer_pages, resolve_ratios
from lserve.sparsity.kv_read import KVReadMeter, ring_tokens, selected_tokens, step_read
from lserve.sparsity.layer_select import resolve_select_layers
from lserve.sparsity.plan import SeqPlan, SeqStep, StepPlan, StepPlanner, layer_budget
from lserve.sparsity.prefill_blocks import PrefillBlocks, causal_tile_count, cut_blocks, estimate_masses, prefill_blocks
from lserve.sparsity.prefill_taus import resolve_layer_taus


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
    #: Runs per-layer budgets (``SparsityConfig.adaptive_budgets``).
    supports_adaptive_budgets = False
    #: Runs dynamic block-sparse prefill (``SparsityConfig.prefill_sparsity``).
    supports_prefill_sparsity = False

    def __init__(self, model: ModelConfig, sparsity: SparsityConfig, cache: KVCache) -> None:
        self.model, self.sp, self.cache = model, sparsity, cache
        self.group = model.group_size
        self.scale = model.head_dim ** -0.5
        device = cache.device
        self.planner = StepPlanner(sparsity, cache, device)
        self.selector_stats = SelectorStats()
        # One flag per layer from ``select_layers`` (raises ConfigError on a layer-count mismatch).
        self.select_layers = resolve_select_layers(sparsity.select_layers, model)
        # No layer selects: plan every decode step as below the threshold (no selector state).
        self._selecting = tuple(self.layer_selects(i) for i in range(model.num_layers))
        self.planner.selects = any(self._selecting)
        # Per-layer budget ratios (None: every selecting layer keeps the request's budget).
        self.layer_ratios = resolve_ratios(sparsity.adaptive_budgets, model)
        if self.layer_ratios is not None and not self.supports_adaptive_budgets:
            raise ConfigError(f"adaptive_budgets runs on the torch and cupy backends only, not {self.name!r}")
        # Per-layer taus of prefill_sparsity "auto" (None: no calibration, or a fixed tau).
        self.prefill_layer_taus, self.prefill_taus_source = resolve_layer_taus(sparsity.prefill_sparsity, model)
        if sparsity.prefill_sparsity != 0 and not self.supports_prefill_sparsity:
            raise ConfigError(f"prefill_sparsity runs on the torch and cupy backends only, not {self.name!r}")
        #: Block-sparse prefill tiles: [kept, causal] over every dense KV head so far.
        self.prefill_tiles = [0, 0]
        # Decode KV reads as a fraction of dense attention's (lserve.sparsity.kv_read), per step.
        self.kv_read = KVReadMeter()

    def chunk_align(self, prompt_tokens: int) -> int:
        """A grid on which the chunks of a prompt this long run faster (0: none), so that the
        engine ends its prefill-only chunks there (``LLMEngine._chunk_rule``)."""
        return 0

    def warm_up(self, max_len: int, max_chunk: int) -> int:
        """Build what later steps would otherwise build on the way (kernel plans for prompts up to
        ``max_len`` tokens in chunks of at most ``max_chunk``); returns how many shapes ran."""
        return 0

    def plan(self, steps: list[SeqStep], host: bool = False) -> StepPlan:
        """Everything the layers of one forward step read, built once before the first of them
        (``host``: a decode-only step the engine may replay as a CUDA graph; its tensors stay on
        the CPU, and :meth:`eager_plan` makes it runnable eagerly)."""
        plan = self.planner.plan(steps, host)
        self.meter_kv_reads(plan)
        if self.cache.host_tier is not None:  # pages this step writes and decoders' windows go resident
            self.cache.host_tier.prepare(SeqSpan(s.step.seq_id, s.step.dense_pages, s.step.start, s.length,
                                                 s.step.decode) for s in plan.seqs)
        return plan

    def eager_plan(self, plan: StepPlan, device) -> StepPlan:
        """A ``host`` plan that is not replayed as a CUDA graph, ready to run eagerly: its tensors
        on ``device`` (a backend with its own tables builds their eager form here)."""
        return plan.to(device)

    def meter_kv_reads(self, plan: StepPlan) -> None:
        """Add the decode sequences of ``plan`` to :attr:`kv_read` (host arithmetic on the plan's
        integers: nothing is read from the device)."""
        decode = [s for s in plan.seqs if s.step.decode]
        if not decode:
            return
        c, meter = self.cache, self.kv_read
        N = c.page_size
        group = self.group if self.sp.select_mode == "query" else 1
        meter.begin_step()
        for s in decode:
            stream = ring_tokens(c.ring.page_in_slot(s.length), s.length, N) if c.has_streaming else 0
            per_layer = None  # no layer reads a selection
            if s.dynamic:
                per_layer = [None] * len(self._selecting)
                for i in range(len(per_layer)):
                    k = self.layer_budget(i, s)
                    if k:
                        per_layer[i] = selected_tokens(s.length, N, k, s.pages_at_select, group)
            meter.add(s.step.seq_id, *step_read(c.n_dense, self.model.num_kv_heads, s.length, stream, per_layer))

    def layer_ratio(self, layer: int) -> float | None:
        """The layer's budget ratio (adaptive budgets), None: the sequences' own budget."""
        return None if self.layer_ratios is None else self.layer_ratios[layer]

    def layer_budget(self, layer: int, sp: SeqPlan) -> int:
        """Pages ``layer`` reads from decode sequence ``sp``'s selection; 0: every page (no
        selection there, or :func:`~lserve.sparsity.plan.layer_budget` says its budget covers them)."""
        if not (sp.dynamic and self._selecting[layer]):
            return 0
        return layer_budget(self.layer_ratio(layer), sp.budget_pages, sp.pages_at_select, self.cache.page_size)

    def layer_budget_pages(self, layer: int, budget_pages: int) -> int:
        """Pages a selecting layer keeps at a (mean) budget of ``budget_pages``, whatever the
        context (reports; whether a sequence reads its selection is :meth:`layer_budget`)."""
        return layer_pages(self.layer_ratio(layer), budget_pages, self.cache.page_size)

    def prefill_tau(self, sp: SeqPlan, layer: int) -> float:
        """The estimated mass a prefill chunk's dense heads keep in ``layer`` (0: the chunk runs
        dense): the request's override, else the config ("auto": the layer's calibrated tau, a
        layer calibrated to keep everything running dense), from ``prefill_sparsity_min_len``
        tokens of context on."""
        tau = self.sp.request_prefill_sparsity(sp.step.prefill_sparsity)
        if tau < 0:
            taus = self.prefill_layer_taus
            tau = taus[layer] if taus is not None and taus[layer] < 1.0 else 0.0
        return tau if sp.step.start + sp.step.num_new >= self.sp.prefill_sparsity_min_len else 0.0

    def estimate_masses(self, q: torch.Tensor, k: torch.Tensor, start: int, block: int, scale: float,
                        estimator: str, stride: int, q_block: int | None) -> torch.Tensor:
        """Estimated tile masses of a prefill chunk (:func:`lserve.sparsity.prefill_blocks.estimate_masses`,
        the torch code every backend can run; a backend with a faster exact path overrides it)."""
        return estimate_masses(q, k, start, block, scale, estimator, stride, q_block)

    def cut_blocks(self, mass: torch.Tensor, group: int, tau: float, start: int, length: int, block: int,
                   q_block: int | None, dense_from: int | None) -> PrefillBlocks:
        """A prefill chunk's block list from its estimated masses (:func:`lserve.sparsity.prefill_blocks.cut_blocks`,
        the torch code every backend can run; a backend with a faster exact path overrides it)."""
        return cut_blocks(mass, group, tau, start, length, block, q_block, dense_from)

    def sparse_prefill_blocks(self, sp: SeqPlan, layer: int, qd: torch.Tensor, kd: torch.Tensor) -> PrefillBlocks | None:
        """The dense heads' block list of a prefill chunk, or None where it runs dense
        (:meth:`prefill_tau`); rows holding the prompt's last ``prefill_q_block`` positions keep
        every causal tile. qd: [Hd*G, n, D] the chunk's queries; kd: [Hd, start + n, D]."""
        tau = self.prefill_tau(sp, layer)
        if not tau:
            return None
        end = sp.step.prefill_end
        blocks = prefill_blocks(qd, kd, sp.step.start, self.sp.prefill_block, self.scale, tau,
                                self.sp.prefill_estimator, self.sp.prefill_stride, self.sp.prefill_q_block,
                                dense_from=end - self.sp.prefill_q_block if end else None,
                                estimate=self.estimate_masses, cut=self.cut_blocks)
        self.prefill_tiles[0] += blocks.indices.numel()
        self.prefill_tiles[1] += blocks.causal_tiles() * kd.shape[0]
        return blocks

    def prefill_kept_since(self, before: list[int]) -> float | None:
        """Kept share of causal prefill tiles since ``before`` (a copy of :attr:`prefill_tiles`);
        None when no block-sparse prefill ran in between."""
        kept, causal = (a - b for a, b in zip(self.prefill_tiles, before))
        return round(kept / causal, 4) if causal else None

    def prefill_computed_share(self, before: list[int], chunks: list[tuple[int, int]]) -> float:
        """Share of the dense heads' causal tiles that block-sparse ``chunks`` ((start, end) of each
        chunk of a block-sparse prefill, every layer) computed since ``before`` (a copy of
        :attr:`prefill_tiles`); layers that ran them dense (calibrated so, or below the length)
        count whole."""
        kept, causal = (a - b for a, b in zip(self.prefill_tiles, before))
        per_head = sum(causal_tile_count(s, e, self.sp.prefill_block, self.sp.prefill_q_block) for s, e in chunks)
        total = per_head * sum(self.cache.n_dense)
        return (kept + total - causal) / total if total else 1.0

    def release(self, seq_id: int) -> None:
        """Drop per-sequence state (selection reuse) of a finished/aborted/preempted sequence."""
        self.planner.release(seq_id)
        self.kv_read.release(seq_id)
        if self.cache.host_tier is not None:
            self.cache.host_tier.release(seq_id)

    def layer_selects(self, layer: int) -> bool:
        """Dynamic selection applies to this layer (not forced dense, in ``select_layers``, has
        dense heads)."""
        return layer >= self.sp.dense_layers and self.select_layers[layer] and self.cache.n_dense[layer] > 0

    @abstractmethod
    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Attention of one layer.

        q: [T, H_q, D], k, v: [T, H_kv, D] (RoPE applied) -> [T, H_q, D].
        """
