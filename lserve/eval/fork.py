"""Decode several variants of one prefill: fork a sequence once its prompt is cached.

Configurations that share the head layout (pattern, static sparsity) and the engine-level
settings (reuse interval, selection mode) compute *identical* prefills: decode token budgets
only act at decode time (the first output token comes from the prefill logits). On a CPU the
prefill is nearly all the cost, so the harness prefills each prompt once per engine and forks
the sequence into one copy per budget variant: the copies get their own KV pages (dense pool,
key statistics and streaming ring, copied from the source) and their own sampling parameters,
and decode independently. The result is the same as running each variant from scratch
(``tests/eval/test_fork.py`` checks it); only the prefill is not repeated.

This reads the engine's cache and scheduler state directly (``LLMEngine.cache``,
``scheduler.running``, ``Sequence``), so it is kept small and covered by that test.
"""

from __future__ import annotations

from lserve.engine.sampling import SamplingParams
from lserve.engine.sequence import RequestOutput, Sequence, Status


def _copy_pool_pages(pool, src: list[int], dst: list[int]) -> None:
    """Copy whole pages of a PagedPool (data and any quantization scales/zeros)."""
    import torch

    s = torch.tensor(src, dtype=torch.long, device=pool.k.device)
    d = torch.tensor(dst, dtype=torch.long, device=pool.k.device)
    for name in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero"):
        t = getattr(pool, name, None)
        if t is not None and t.numel():
            t[d] = t[s]


def fork_sequence(engine, src: Sequence, params: SamplingParams, request_id: str) -> Sequence:
    """A running copy of ``src`` (prefilled, first token sampled) that decodes with ``params``.

    Raises
    ------
    RuntimeError
        If ``src`` is not exactly between its prefill and its first decode step, or the cache
        cannot hold the copy.
    """
    import torch

    if not (src.in_decode and src.num_computed == len(src.prompt_ids) and len(src.output_ids) == 1):
        raise RuntimeError(f"can only fork right after the prefill (sequence {src.request_id})")
    cache = engine.cache
    n_dense, n_ring = len(src.dense_pages), len(src.stream_pages)
    if not cache.dense_alloc.can_allocate(n_dense) or not cache.stream_alloc.can_allocate(n_ring):
        raise RuntimeError("the KV cache is too small to fork: raise max_tokens / max_num_seqs")
    seq = Sequence(engine.new_sequence_id(), request_id, src.prompt_ids, params, src.arrival)
    seq.first_scheduled = src.first_scheduled
    seq.append_token(src.output_ids[0], engine.tokenizer, engine.eos_ids, engine.max_model_len)
    seq.num_computed = src.num_computed
    seq.in_decode = True
    seq.status = Status.RUNNING
    seq.dense_pages = cache.dense_alloc.allocate(n_dense)
    seq.stream_pages = cache.stream_alloc.allocate(n_ring) if n_ring else []
    with torch.no_grad():
        for layer in range(len(cache.dense)):
            _copy_pool_pages(cache.dense[layer], src.dense_pages, seq.dense_pages)
            st = cache.stats[layer]
            s = torch.tensor(src.dense_pages, dtype=torch.long, device=st.kmax.device)
            d = torch.tensor(seq.dense_pages, dtype=torch.long, device=st.kmax.device)
            if st.kmax.numel():
                st.kmax[d] = st.kmax[s]
                st.kmin[d] = st.kmin[s]
            if n_ring:
                _copy_pool_pages(cache.stream[layer], src.stream_pages, seq.stream_pages)
    engine.add_running_sequence(seq)
    return seq


class ReuseOverride:
    """Per-sequence reuse interval C' on an engine whose planner runs with its own C.

    Before each step is planned, for every overridden sequence that is decoding, the planner's
    record of its last selection is either dropped (the selector may run now: never ran, or
    step - last >= C') or set to the coming step (the last selection is reused). After the
    plan, a selection counts only if the planner really made one (it does only while selection
    is active). This is the planner's own rule with C' in place of C. Used as a context manager
    it brackets every ``planner.plan`` call, so it holds however many steps one ``engine.step()``
    plans (async decode plans the next decode step before the current one's tokens are read).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.planner = engine.backend.planner
        self.interval: dict[int, int] = {}  # seq_id -> C'
        self.last: dict[int, int] = {}  # seq_id -> decode step of its last real selection
        self._allowed: dict[int, int] = {}  # seq_id -> step at which selection was allowed

    def set(self, seq: Sequence, interval: int) -> None:
        self.interval[seq.seq_id] = interval

    def __enter__(self) -> ReuseOverride:
        plan = self.planner.plan

        def bracketed(steps, host: bool = False):
            self.before_step()
            out = plan(steps, host)
            self.after_step()
            return out

        self.planner.plan = bracketed  # an instance attribute over the class's method
        return self

    def __exit__(self, *exc) -> None:
        del self.planner.plan

    def before_step(self) -> None:
        pl = self.planner
        self._allowed = {}
        for seq in self.engine.scheduler.running:
            c = self.interval.get(seq.seq_id)
            if c is None or not seq.in_decode:
                continue
            step, _ = pl.selection_state(seq.seq_id)  # index the coming decode step will get
            last = self.last.get(seq.seq_id)
            if last is None or step - last >= c:
                pl.set_last_selection(seq.seq_id, None)
                self._allowed[seq.seq_id] = step
            else:
                pl.set_last_selection(seq.seq_id, step)

    def after_step(self) -> None:
        for seq_id, step in self._allowed.items():
            if self.planner.selection_state(seq_id)[1] == step:
                self.last[seq_id] = step


def add_kv_read(out: RequestOutput, totals) -> None:
    """Put a finished request's decode KV reads (:class:`~lserve.sparsity.kv_read.KVReadTotals`,
    or None if it never decoded) into its metrics: ``kv_read_fraction`` (of dense attention's
    KV bytes), ``kv_read_head_tokens`` and ``kv_dense_head_tokens``."""
    if totals is None or not totals.dense:
        return
    out.metrics.update(kv_read_fraction=totals.fraction, kv_read_head_tokens=totals.read,
                       kv_dense_head_tokens=totals.dense)


def generate_variants(engine, prompts: list[list[int]], variants: list[list[SamplingParams]],
                      reuse: list[list[int | None]] | None = None) -> list[list[RequestOutput]]:
    """Run each prompt once through prefill and decode it under every one of its variants.

    Parameters
    ----------
    prompts : list of token-id lists
    variants : list of lists of SamplingParams
        ``variants[i]`` are the decode settings of prompt ``i`` (same ``max_tokens`` and
        greedy sampling expected: the first token comes from the shared prefill).
    reuse : list of lists of int or None, optional
        ``reuse[i][j]``: page-selection reuse interval of variant ``j`` of prompt ``i``
        (None: the engine's).

    Returns
    -------
    list of lists of RequestOutput
        ``out[i][j]`` is prompt ``i`` decoded with ``variants[i][j]``; its ``metrics`` hold the
        variant's decode KV reads (:func:`add_kv_read`).
    """
    if len(prompts) != len(variants) or any(not v for v in variants):
        raise ValueError("need one non-empty list of variants per prompt")
    reuse = reuse or [[None] * len(v) for v in variants]
    meter = engine.backend.kv_read
    with ReuseOverride(engine) as override:  # per planned step, however step() plans them
        src_ids = [engine.add_request(p, v[0]) for p, v in zip(prompts, variants)]
        seq_ids = {src: engine.sequence(src).seq_id for src in src_ids}
        for i, src in enumerate(src_ids):
            if reuse[i][0] is not None:
                override.set(engine.sequence(src), reuse[i][0])
        rids = [[src] + [f"{src}/v{j}" for j in range(1, len(v))] for src, v in zip(src_ids, variants)]
        forked = [len(v) == 1 for v in variants]
        final: dict[str, RequestOutput] = {}
        while len(final) < sum(len(r) for r in rids):
            outs = engine.step()
            for o in outs:
                if o.finished:
                    final[o.request_id] = o
                    add_kv_read(o, meter.pop(seq_ids.get(o.request_id, -1)))
            for i, src_id in enumerate(src_ids):
                if forked[i]:
                    continue
                seq = engine.sequence(src_id)
                if seq is None:  # finished at its first token (EOS or max_tokens 1): every variant is the same
                    if src_id in final:
                        for rid in rids[i][1:]:
                            final[rid] = final[src_id]
                        forked[i] = True
                    continue
                if seq.in_decode and len(seq.output_ids) == 1:
                    for rid, params, c in zip(rids[i][1:], variants[i][1:], reuse[i][1:]):
                        copy = fork_sequence(engine, seq, params, rid)
                        seq_ids[rid] = copy.seq_id
                        if c is not None:
                            override.set(copy, c)
                    forked[i] = True
            if not outs and not engine.has_unfinished() and len(final) < sum(len(r) for r in rids):
                raise RuntimeError("engine stopped before every variant finished")
        return [[final[r] for r in row] for row in rids]
