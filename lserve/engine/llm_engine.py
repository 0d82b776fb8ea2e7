"""The synchronous engine: requests in, one batched forward per ``step()``, outputs out.

Data flows ``add_request -> Scheduler.schedule -> StepPlanner/backend.plan -> LlamaModel.forward
-> sample -> Sequence.append_token -> RequestOutput``. Consecutive greedy decode steps overlap
the host work of one with the GPU work of the other (:mod:`lserve.engine.async_decode`).
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from lserve.attention import make_backend
from lserve.attention.base import SelectorStats
from lserve.cache.host_tier import HostKVStats, stage_entries
from lserve.cache.kv_cache import KVCache
from lserve.cache.page_hash import namespace_seed
from lserve.config import PREFILL_MIN_LEN_UNPROFILED, ConfigError, EngineConfig, ModelConfig, SparsityConfig
from lserve.engine.async_decode import HostTokens, LaunchedStep
from lserve.engine.cuda_graphs import DecodeGraphs
from lserve.engine.request_check import RequestCheck, RequestError
from lserve.engine.sampling import (
    SampleLogprobs,
    SamplingParams,
    StepExtras,
    needs_processing,
    process_logits,
    prompt_logprob_chunk,
    sample,
)
from lserve.engine.scheduler import ChunkRule, Scheduled, Scheduler
from lserve.engine.sequence import RequestOutput, Sequence
from lserve.engine.step_budget import StepBudget, attention_alpha
from lserve.models.llama import LlamaModel
from lserve.models.loader import LoadedModel, load_model
from lserve.models.tokenizer import encode_prompt
from lserve.sparsity.in_effect import in_effect
from lserve.sparsity.kv_read import KVReadTotals
from lserve.sparsity.patterns import HeadLayout, load_pattern, random_pattern
from lserve.sparsity.plan import SeqStep
from lserve.sparsity.prefill_taus import default_calibration_for
from lserve.sparsity.threshold import PREFILL, lookup, lookup_ratio, profile_key

log = logging.getLogger("lserve")


@dataclass
class EngineStats:
    """Counters and gauges the serving layer exports."""

    running: int
    waiting: int
    kv_usage: dict
    dense_pages_used: int
    num_preemptions: int
    steps: int
    prompt_tokens: int
    generation_tokens: int
    step_kinds: dict = field(default_factory=dict)  # steps by kind: graph, mixed_graph, decode_eager, mixed, prefill
    dense_pages_total: int = 0
    stream_pages_used: int = 0
    all_pages_free: bool = True
    last_step: dict = field(default_factory=dict)  # LLMEngine.last_step_info of the latest step
    selector: SelectorStats | None = None  # a copy of the backend's page-selection totals
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, tokens reused from it
    prefix_cached_pages: int = 0  # dense pages the prefix cache holds (read by a sequence or idle)
    prefix_evictions: int = 0  # cached pages given back for new allocations
    prefix_recent_evicted: list = field(default_factory=list)  # (wall time, hash) of the latest evictions
    kv_read: KVReadTotals | None = None  # decode KV head-tokens read vs dense (lserve.sparsity.kv_read)
    host_kv: HostKVStats | None = None  # the host KV tier's counters (None: tier off)
    step_seconds: dict = field(default_factory=dict)  # per step kind: [wall s, prefill part s] summed
    budget: dict = field(default_factory=dict)  # what the step budget has learnt (StepBudget.learnt)


@dataclass
class _Part:
    """One launched forward of a step (a step that decodes and prefills may launch two)."""

    samplers: list  # sequences that get a token, in logit-row order
    spans: list  # prompt-logprob spans (seq, first scored token, rows)
    logits: torch.Tensor | None  # float32 [len(samplers), V]
    greedy: torch.Tensor | None  # long [len(samplers)]
    hidden: torch.Tensor | None  # [rows of spans, H] final hidden states (prompt logprobs)
    num_tokens: int
    graph: bool  # a CUDA-graph replay


def build_layout(cfg: EngineConfig, mc: ModelConfig) -> HeadLayout:
    """The head layout from the sparsity config: all dense, a file pattern, the shipped pattern of
    model ``mc`` (``"auto"``, found by the model's identity; all dense, with a log line, when none
    ships for it) or a random one."""
    from lserve.sparsity.shipped import auto_pattern

    sparsity = cfg.sparsity
    num_layers, num_kv_heads = mc.num_layers, mc.num_kv_heads
    source = (auto_pattern(mc) if sparsity.streaming_enabled() else None) if sparsity.pattern == "auto" else sparsity.pattern
    if not sparsity.streaming_enabled() or source is None:
        return HeadLayout.all_dense(num_layers, num_kv_heads)
    pattern = (random_pattern(num_layers, num_kv_heads, sparsity.pattern_seed) if source == "random"
               else load_pattern(source))
    return HeadLayout.from_pattern(pattern, num_layers, num_kv_heads, sparsity.static_sparsity, sparsity.dense_layers)


def step_alpha(mc, layout: HeadLayout) -> float:
    """:func:`~lserve.engine.step_budget.attention_alpha` of a model with this head layout."""
    return attention_alpha(mc.hidden_size, mc.intermediate_size, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                           [n * mc.group_size for n in layout.n_dense()])


def resolve_prefill(sparsity: SparsityConfig, device: str, model_cfg, dtype) -> tuple[SparsityConfig, str | None, str | None]:
    """``sparsity`` with its prefill settings resolved, the profile file its length came from (None:
    not from a profile), and why block-sparse prefill is off (None: it is on, or off by request).

    * ``prefill_sparsity_min_len`` "auto" (-1): the profiled length of this device and model shape;
      without a profile, :data:`~lserve.config.PREFILL_MIN_LEN_UNPROFILED` (where a set tau, or a
      request's own, starts).
    * ``prefill_sparsity`` "auto" (the default) is on only where both were measured: the model ships
      its per-layer taus (``lserve calibrate-prefill``) and, unless the user set a length, a profile
      of this device and shape (``lserve bench profile-prefill-threshold``) says from where it pays.
      Otherwise it is off: an unmeasured speed-up is not assumed.
    """
    min_len, source, found = sparsity.prefill_sparsity_min_len, None, None
    if min_len < 0:
        found = lookup(profile_key(device, model_cfg, dtype), PREFILL, "min_len")
        min_len, source = (int(found[0]), found[1]) if found else (PREFILL_MIN_LEN_UNPROFILED, None)
    why_off = None
    if sparsity.prefill_sparsity < 0:  # auto
        if default_calibration_for(model_cfg) is None:
            why_off = f"no prefill calibration ships for model {model_cfg.name!r}"
        elif sparsity.prefill_sparsity_min_len < 0 and found is None:
            why_off = "no profile of this device and model shape says where it pays (lserve bench profile-prefill-threshold)"
    tau = 0.0 if why_off else sparsity.prefill_sparsity  # a request's own tau still runs from min_len
    return replace(sparsity, prefill_sparsity=tau, prefill_sparsity_min_len=min_len), source, why_off


def build_cache(cfg: EngineConfig, model_cfg, layout: HeadLayout, dtype) -> KVCache:
    """The two-way paged KV cache an engine with config ``cfg`` allocates."""
    sparsity = cfg.sparsity
    return KVCache(model_cfg, cfg.cache, layout.n_dense(), sparsity.sink_tokens, sparsity.local_tokens, cfg.max_num_seqs,
                   dtype, cfg.device, prefix_cache=cfg.prefix_cache, prefix_seed=namespace_seed(cfg.prefix_namespace()),
                   max_batched_tokens=cfg.max_batched_tokens,
                   host_device="mapped" if cfg.backend == "cupy" else "cpu",  # the cupy kernels read host pages in place
                   stage_entries=tier_stage_entries(cfg.backend, sparsity, cfg.cache.page_size))


def tier_stage_entries(backend: str, sparsity: SparsityConfig, page_size: int) -> int:
    """Pages per sequence a host tier sets aside to stage selections in
    (:func:`~lserve.cache.host_tier.stage_entries`): the cupy kernels read staged picks; the torch
    backend reads host pages where they are."""
    return stage_entries(sparsity.token_budget, page_size) if backend == "cupy" else 0


class LLMEngine:
    """Continuous-batching engine over the two-way paged cache.

    Parameters
    ----------
    config : EngineConfig
    loaded : LoadedModel, optional
        Reuse weights already in memory (tests, several engines over one model); the caller keeps
        them. Without it the engine loads the model itself and keeps only the weights its model
        holds (:attr:`loaded` then has none): the checkpoint's own copies of the tensors the model
        fuses would otherwise stay in memory beside the fused ones (on a GPU with a preset
        Llama-3-8B, 9.5 GiB).
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        dtype = config.torch_dtype()
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for but no CUDA GPU is available")
        self.loaded = loaded or load_model(config.model, dtype=dtype, device=config.device, seed=config.seed)
        mc = self.loaded.config
        self.model_config = mc
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if mc.head_dim % 2 or (config.cache.kv_quant == "int4" and mc.head_dim % 2):
            raise ConfigError("INT4 KV needs an even head_dim")
        self.layout = build_layout(config, mc)
        self.model = LlamaModel(mc, self.loaded.weights, self.layout, dtype, config.device)
        if loaded is None:  # the model holds what it needs (fused copies of q/k/v, gate/up, o): drop the rest
            self.loaded = replace(self.loaded, weights={})
        sparsity, self.prefill_threshold_source, prefill_off = resolve_prefill(config.sparsity, config.device, mc, dtype)
        #: the sparsity settings in effect (``config.sparsity`` with its "auto" values resolved)
        self.sparsity = sparsity
        self.cache = build_cache(config, mc, self.layout, dtype)
        self.backend = make_backend(config.backend, mc, sparsity, self.cache)
        if prefill_off is not None:
            log.info("block-sparse prefill: off (%s)", prefill_off)
        elif sparsity.prefill_sparsity < 0:
            log.info("block-sparse prefill: per-layer taus from %s, from %d tokens", self.backend.prefill_taus_source,
                     sparsity.prefill_sparsity_min_len)
        self.sparsity_in_effect = in_effect(sparsity, mc, self.layout.streaming_fraction())
        self.threshold_source = None
        if sparsity.dynamic_threshold < 0:  # auto: the profile of this device and model shape, if any
            found = lookup_ratio(profile_key(config.device, mc, dtype))
            if found is not None:
                self.backend.planner.threshold_ratio, self.threshold_source = found
        self.fused_problem = None
        if config.fused_ops and self.backend.name == "cupy":
            self.fused_problem = self.model.enable_fused()
            if self.fused_problem:
                log.warning("fused kernels disabled (%s): using the torch elementwise path", self.fused_problem)
        self.graphs = None
        if config.cuda_graphs and self.backend.name == "cupy" and DecodeGraphs.supported(self.model, self.max_model_len):
            self.graphs = DecodeGraphs(self.model, self.backend, config.max_num_seqs, self.max_model_len)
        budget = StepBudget.for_engine(config, step_alpha(mc, self.layout))
        # The scheduler reaches _chunk_rule through a weak reference: a bound method would close
        # the cycle engine -> scheduler -> engine, and an engine dropped by its last owner would
        # keep its KV pool and weight copies until the cyclic GC ran (it counts objects, not bytes).
        chunk_rule = weakref.WeakMethod(self._chunk_rule)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, budget, self.backend.release,
                                   lambda seq, decoding: chunk_rule()(seq, decoding))
        self.eos_ids = tuple(set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids))
        self.request_check = RequestCheck(mc.vocab_size, self.max_model_len, self.cache.page_size,
                                          self.cache.dense_alloc.num_pages, self.backend.name,
                                          self.backend.supports_prefill_sparsity)
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.steps = 0
        self.step_kinds: Counter = Counter()
        # per kind: [wall seconds, seconds of the prefill part timed apart] (where a step's time goes)
        self.step_seconds: dict[str, list[float]] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.last_step_info: dict = {}
        self._host_tokens = HostTokens(config.device, config.max_num_seqs)
        self._pending: LaunchedStep | None = None  # launched, tokens not read yet (async decode)

    def warm_up(self) -> float:
        """Build the kernel plans long prompts will need (cuDNN's per shape, on a GPU) before the
        first one arrives; a server calls it at start. Returns the seconds it took."""
        t0 = time.perf_counter()
        n = self.backend.warm_up(self.max_model_len, self.config.max_batched_tokens)
        if n:
            log.info("warm-up: %d chunk attention shapes in %.1f s", n, time.perf_counter() - t0)
        return time.perf_counter() - t0

    # -- requests -----------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        """Token ids of a text prompt, a token list, or chat messages (with the chat template)."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise :class:`RequestError` if the request can never be served (:meth:`RequestCheck.request`)."""
        self.request_check.request(prompt_ids, params)

    def _sparse_prefill(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prompt is prefilled block-sparse (its chunks from the length on)."""
        sparsity = self.sparsity
        return (sparsity.request_prefill_sparsity(seq.params.prefill_sparsity) != 0
                and len(seq.prompt_ids) >= sparsity.prefill_sparsity_min_len)

    def _chunk_rule(self, seq: Sequence, decoding: bool) -> ChunkRule:
        """How chunks of ``seq`` are cut. cuDNN builds a plan per new shape (0.07-0.9 s on the H200,
        ``benchmarks/probes/probe_cudnn_causal_h200.json``), so chunks that run it end on a grid
        where plans repeat:

        * a block-sparse prefill's chunks on its row grid (``prefill_q_block``), in every step: a
          chunk edge inside a row gives that row's calls shapes no other chunk has; the step budget
          costs them at the share of attention they compute;
        * a long prompt's chunks on the backend's grid (:meth:`AttentionBackend.chunk_align`) in
          steps without decodes, whose chunks are large; a chunk next to decodes stays as small as
          the step budget says (the backend runs an off-grid chunk through flash).
        """
        if self._sparse_prefill(seq):
            return ChunkRule(self.sparsity.prefill_q_block, sparse=True)
        # the tokens this prefill covers (a recomputed sequence's outputs too): SeqStep.prefill_end
        return ChunkRule(0 if decoding else self.backend.chunk_align(seq.num_tokens))

    def add_request(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None,
                    request_id: str | None = None, chat: bool = False, arrival: float | None = None) -> str:
        """Queue a request; returns its id. Raises :class:`RequestError` for unservable input."""
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt, chat)
        self.check_request(ids, params)
        if params.prefill_sparsity not in (None, self.sparsity.prefill_sparsity):
            # its pages hold K/V of another prefill than the engine's: neither reuse nor share them
            params = replace(params, prefix_cache=False)
        seq_id = next(self._ids)
        rid = request_id or f"req-{seq_id}"
        if rid in self._seqs:
            raise RequestError(f"request id {rid!r} is already in use")
        seq = Sequence(seq_id, rid, ids, params, arrival)
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def sequence(self, request_id: str) -> Sequence | None:
        """The live sequence of a request, or None once it finished, was aborted or is unknown."""
        return self._seqs.get(request_id)

    def new_sequence_id(self) -> int:
        """A fresh sequence id (for :meth:`add_running_sequence`)."""
        return next(self._ids)

    def add_running_sequence(self, seq: Sequence) -> None:
        """Adopt an already prefilled sequence (e.g. a fork) straight into the running set.

        Parameters
        ----------
        seq : Sequence
            Holds its own cache pages and a fresh id from :meth:`new_sequence_id`.

        Raises
        ------
        RequestError
            If its request id is already in use.
        """
        if seq.request_id in self._seqs:
            raise RequestError(f"request id {seq.request_id!r} is already in use")
        self._seqs[seq.request_id] = seq
        self.scheduler.running.append(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages now. Returns False if it is unknown or done."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        self.scheduler.finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        c = self.cache
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), c.usage(),
                           c.dense_alloc.num_used, self.scheduler.num_preemptions, self.steps,
                           self.prompt_tokens, self.generation_tokens, dict(self.step_kinds),
                           c.dense_alloc.num_pages, c.stream_alloc.num_used, c.all_free(), dict(self.last_step_info),
                           replace(self.backend.selector_stats), kv_read=replace(self.backend.kv_read.total),
                           prefix_cache_queries=c.prefix.stats.queries, prefix_cache_hits=c.prefix.stats.hits,
                           prefix_cached_pages=c.prefix.num_cached, prefix_evictions=c.prefix.stats.evictions,
                           prefix_recent_evicted=list(c.prefix.stats.recent_evicted),
                           host_kv=c.host_tier.stats() if c.host_tier is not None else None,
                           step_seconds={k: list(v) for k, v in self.step_seconds.items()},
                           budget=self.scheduler.budget.learnt())

    def describe(self) -> dict:
        """Facts that do not change while the engine runs (for the serving layer's gauges and views)."""
        return {"max_model_len": self.max_model_len, "page_size": self.cache.page_size,
                "token_budget": self.config.sparsity.token_budget,
                "streaming_fraction": self.layout.streaming_fraction(), "prefix_cache": self.cache.prefix.enabled,
                "sparsity": dict(self.sparsity_in_effect)}

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward over the batch, sample; returns outputs of touched requests.

        With ``async_decode`` a pure greedy decode step launches the next one before its tokens
        are read, so the GPU runs step t+1 while the host finishes step t (see
        :mod:`lserve.engine.async_decode`); the outputs are those of the synchronous engine.
        """
        t0 = time.perf_counter()
        launched, self._pending = self._pending, None
        if launched is not None and not launched.live():
            launched = None  # every row finished or was aborted: nothing to read (stream order keeps it safe)
        prefill_cost = 0.0
        if launched is None:
            batch = self.scheduler.schedule()
            if not batch:
                return []
            prefill_cost = self.scheduler.last_prefill_cost
            sparse = [(b.seq.num_computed, b.seq.num_computed + b.num_tokens) for b in batch
                      if not b.decode and self._sparse_prefill(b.seq)]
            tiles0 = list(self.backend.prefill_tiles) if sparse else None
            launched = self._launch(batch)
            if sparse:  # the step budget costs block-sparse chunks at what they computed
                self.scheduler.budget.observe_sparse(self.backend.prefill_computed_share(tiles0, sparse))
        self._pending = self._chain(launched)
        outputs = self._finish(launched)
        n_decode = sum(1 for b in launched.batch if b.decode)
        budget = self.scheduler.budget
        prefill_s = None
        if budget.timed and prefill_cost and self.config.device.startswith("cuda"):
            torch.cuda.synchronize(self.config.device)  # a chunk that samples nothing is not waited for otherwise
            if launched.prefill_marks is not None:
                prefill_s = launched.prefill_marks[0].elapsed_time(launched.prefill_marks[1]) / 1e3
        seconds = time.perf_counter() - t0
        if budget.timed:
            budget.observe(prefill_cost, n_decode, seconds, prefill_s)
        self.steps += 1
        n_prefill = len(launched.batch) - n_decode
        kind = (("mixed_graph" if n_prefill else "graph") if launched.graph else
                "mixed" if n_decode and n_prefill else "prefill" if n_prefill else "decode_eager")
        self.step_kinds[kind] += 1
        spent = self.step_seconds.setdefault(kind, [0.0, 0.0])
        spent[0] += seconds
        spent[1] += prefill_s or 0.0
        self.last_step_info = {"seconds": seconds, "tokens": launched.num_tokens, "decode": n_decode,
                               "prefill_tokens": sum(b.num_tokens for b in launched.batch if not b.decode),
                               "chained": launched.chained, "graph": launched.graph, "prefill_seconds": prefill_s}
        return outputs

    def _launch(self, batch: list[Scheduled], prev: tuple[torch.Tensor, list[int]] | None = None) -> LaunchedStep:
        """Plan and launch the forward of ``batch`` (nothing waits for it).

        ``prev``: (device tokens of the previous step, row of each sequence in it): the input
        ids are gathered from those on the device (a chained decode step).

        A batch that decodes and prefills, with CUDA graphs on, runs as two forwards: the
        decodes replay their graph (once one is captured) and the prefill chunks run eagerly.
        One eager forward of both costs the host ~60 ms on the H200 for 32 layers whatever the
        chunk size (``scripts/probes/probe_mixed.py``), against ~7 ms for a replay plus a prefill
        forward whose launches hide behind its own GPU time; the weights are read twice, once
        per part (~4 ms at 8B).
        """
        now = time.monotonic()
        for item in batch:
            if item.seq.first_scheduled is None:
                item.seq.first_scheduled = now
        n_dec = sum(1 for item in batch if item.decode)  # decodes come first in a batch
        if self.graphs is not None and prev is None and 0 < n_dec < len(batch):
            # each part is planned once (the planner counts steps per sequence for selection reuse);
            # a decode part with no captured graph yet runs eagerly on its own
            # the prefill part between two CUDA events: a time-targeted step budget learns its own rate
            parts = [self._forward_part(batch[:n_dec], None)]
            marks = None
            if self.scheduler.budget.timed:
                marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                marks[0].record()
            parts.append(self._forward_part(batch[n_dec:], None))
            if marks is not None:
                marks[1].record()
        else:
            parts, marks = [self._forward_part(batch, prev)], None
        samplers = [s for p in parts for s in p.samplers]
        spans = [span for p in parts for span in p.spans]
        sampled = [p for p in parts if p.samplers] or parts[:1]
        logits = sampled[0].logits if len(sampled) == 1 else torch.cat([p.logits for p in sampled])
        greedy_dev = None
        if samplers:
            greedy_dev = sampled[0].greedy if len(sampled) == 1 else torch.cat([p.greedy for p in sampled])
        hidden = parts[-1].hidden  # prompt-logprob rows exist in prefill chunks only
        logits, greedy_dev, extras = self._sampling_extras(logits, greedy_dev, samplers, spans,
                                                           hidden if spans else None)
        for item in batch:
            seq = item.seq
            seq.num_computed += item.num_tokens
            if not item.decode and not seq.prompt_counted and seq.num_computed >= len(seq.prompt_ids):
                # once per request, cached prefix included (vLLM's prompt_tokens): a recompute after
                # preemption or a prefix-cache hit does not change what the request asked for
                seq.prompt_counted = True
                self.prompt_tokens += len(seq.prompt_ids)
        fetch = self._host_tokens.start(greedy_dev) if samplers else None
        return LaunchedStep(batch, samplers, logits, greedy_dev, fetch, sum(p.num_tokens for p in parts),
                            chained=prev is not None, extras=extras, graph=parts[0].graph, prefill_marks=marks)

    def _forward_part(self, batch: list[Scheduled], prev: tuple[torch.Tensor, list[int]] | None) -> _Part:
        """Plan and launch one forward over ``batch`` (a graph replay when it only decodes and a
        graph is captured; eagerly otherwise)."""
        steps, ids, pos, seq_lens, logit_rows, samplers = [], [], [], [], [], []
        spans, hidden_rows = [], []  # prompt logprobs: (seq, first prompt token scored, rows), and those rows
        t = 0
        for item in batch:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed
            steps.append(SeqStep(seq.seq_id, start, n, item.decode, seq.dense_pages, seq.stream_pages,
                                 seq.params.token_budget, seq.params.prefill_sparsity, seq.num_tokens))
            if prev is None:
                ids.extend(seq.tokens(start, start + n))
            pos.extend(range(start, start + n))
            seq_lens.extend([start + n] * n)
            lo, hi = seq.prompt_logprob_span(start, n)
            if hi > lo:  # only this request's rows: position p scores prompt token p + 1
                spans.append((seq, lo + 1, hi - lo))
                hidden_rows.extend(range(t + lo - start, t + hi - start))
            t += n
            if start + n == seq.num_tokens:  # reached the end: this step yields a token
                logit_rows.append(t - 1)
                samplers.append(seq)
        prev_tokens = None
        if prev is not None:
            prev_tokens, ids = prev  # ids: rows of prev_tokens
        dev = self.config.device
        graph_step = self.graphs is not None and all(item.decode for item in batch)
        plan = self.backend.plan(steps, host=graph_step)
        replayed = (self.graphs.run(plan, ids, pos, seq_lens, logit_rows, prev_tokens=prev_tokens)
                    if graph_step else None)
        if replayed is not None:
            return _Part(samplers, spans, replayed[0], replayed[1], None, t, True)
        if graph_step:  # not replayed: the same step with its eager tensors and tables
            plan = self.backend.eager_plan(plan, dev)
        ids_dev = torch.tensor(ids, dtype=torch.long, device=dev)
        if prev_tokens is not None:
            ids_dev = prev_tokens.index_select(0, ids_dev)
        extra = {"hidden_index": torch.tensor(hidden_rows, dtype=torch.long, device=dev)} if hidden_rows else {}
        logits = self.model.forward(
            ids_dev, torch.tensor(pos, dtype=torch.long, device=dev),
            plan, self.backend, torch.tensor(logit_rows, dtype=torch.long, device=dev),
            torch.tensor(seq_lens, dtype=torch.long, device=dev), max(seq_lens), **extra)
        hidden = None
        if hidden_rows:
            logits, hidden = logits
        greedy_dev = self.model.greedy(logits) if samplers else None
        return _Part(samplers, spans, logits, greedy_dev, hidden, t, False)

    def _sampling_extras(self, logits: torch.Tensor | None, greedy: torch.Tensor | None, samplers: list[Sequence],
                         spans: list, hidden: torch.Tensor | None):
        """Logprobs and logit processing of a launched step, on the device (nothing waits).

        Rows without penalties, bias, ``min_tokens`` or logprobs keep the forward's (or graph
        replay's) logits and greedy tokens untouched. Processed rows get their own copy of the
        logits and, when greedy, a recomputed argmax; the result is a new [nb, V] tensor so a
        graph's output buffers are never written.

        Returns
        -------
        (logits [nb, V], greedy [nb], StepExtras or None)
        """
        chunks, off = [], 0
        for seq, first, n in spans:  # hidden: [sum of n, H] in span order
            chunks.append(prompt_logprob_chunk(seq, first, hidden[off: off + n], self.model.lm_logits))
            off += n
        lp_rows = [r for r, s in enumerate(samplers) if s.params.logprobs is not None]
        sample_lps = None
        if lp_rows:  # raw logprobs: before any processing below
            sample_lps = SampleLogprobs.of(logits, lp_rows, [samplers[r].params.logprobs for r in lp_rows])
        proc = [r for r, s in enumerate(samplers) if needs_processing(s)]
        if proc:
            idx = torch.tensor(proc, dtype=torch.long, device=logits.device)
            sub = process_logits(logits.index_select(0, idx), [samplers[r] for r in proc], self.eos_ids)  # [R, V]
            logits = logits.index_copy(0, idx, sub)
            greedy = greedy.index_copy(0, idx, torch.argmax(sub, dim=-1))
        if not (chunks or lp_rows or proc):
            return logits, greedy, None
        return logits, greedy, StepExtras(sample_lps, chunks)

    def _chain(self, prev: LaunchedStep) -> LaunchedStep | None:
        """Launch the decode step after ``prev`` before ``prev``'s tokens are read; None (the
        caller drains ``prev``) when that would differ from what ``schedule()`` does next."""
        if not (self.config.async_decode and prev.pure_greedy_decode) or self.scheduler.waiting:
            return None
        live = prev.live()
        if len(live) != len(self.scheduler.running):
            return None  # something else runs too (a prefill): the scheduler decides
        nxt = [(row, s) for row, s in live if not s.ends_by_length(self.max_model_len)]
        if not nxt or not self.scheduler.reserve_next([s for _, s in nxt]):
            return None  # done, or pages are short: drain first, then schedule() may preempt
        for _, s in nxt:
            s.reserve_token()
        rows = [row for row, _ in nxt]
        return self._launch([Scheduled(s, 1, True) for _, s in nxt], (prev.greedy, rows))

    def _finish(self, st: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens (the decode loop's one wait on the device), append them
        and free finished sequences; the outputs of the sequences that got a token (or, asking
        for prompt logprobs with ``max_tokens`` 0, finished after their prefill)."""
        greedy = self._host_tokens.read(st.fetch) if st.samplers else []
        ex = st.extras
        if ex is not None:
            self._record_prompt_logprobs(ex)
        # finished at the step before or aborted while this one ran: a wasted row
        live = [(row, seq) for row, seq in enumerate(st.samplers) if seq.finish_reason is None]
        logits_cpu = None
        picks: list[int | None] = []
        for row, seq in live:
            if seq.params.max_tokens == 0:
                tok = None
            elif seq.params.greedy:
                tok = greedy[row]
            else:
                if logits_cpu is None:
                    logits_cpu = st.logits.cpu()
                tok = sample(logits_cpu[row], seq.params, seq.generator)
            picks.append(tok)
        lps = self._token_logprobs(ex, live, picks)
        outputs = []
        for (row, seq), tok in zip(live, picks):
            if tok is None:  # the prompt's logprobs were all it asked for
                seq.finish_reason = "length"
            else:
                seq.in_decode = True
                if row in lps:
                    seq.logprobs.append(lps[row])
                seq.append_token(tok, self.tokenizer, self.eos_ids, self.max_model_len)
                self.generation_tokens += 1
            if seq.finish_reason is not None:
                self._seqs.pop(seq.request_id, None)
                self.scheduler.finish(seq)
            outputs.append(seq.snapshot())
        return outputs

    @staticmethod
    def _record_prompt_logprobs(ex: StepExtras) -> None:
        for chunk in ex.prompt_chunks:
            seq = chunk.seq
            # aborted meanwhile, or (never in practice) not the next tokens to record
            if seq.finish_reason is None and len(seq.prompt_logprobs) == chunk.first:
                seq.prompt_logprobs.extend(chunk.entries())

    @staticmethod
    def _token_logprobs(ex: StepExtras | None, live: list, picks: list) -> dict:
        """Sampler row -> logprob entry of the token picked there (one device read)."""
        if ex is None or ex.sample_logprobs is None:
            return {}
        picked = {row: tok for (row, _), tok in zip(live, picks) if tok is not None}
        sl = ex.sample_logprobs
        got = sl.entries([picked.get(r, 0) for r in sl.rows])
        return {r: e for r, e in got.items() if r in picked}

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False, progress: bool = False) -> list[RequestOutput]:
        """Run prompts to completion (batched); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        rids = [self.add_request(prompt, sampling, chat=chat) for prompt, sampling in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(rids), desc="requests", unit="req")
        while len(final) < len(rids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [final[r] for r in rids]


class LLM(LLMEngine):
    """Convenience front door: ``LLM(model="default").generate(["..."], SamplingParams(...))``."""

    def __init__(self, model: str = "default", loaded: LoadedModel | None = None, **kwargs) -> None:
        super().__init__(EngineConfig(model=model, **kwargs), loaded)
