"""Continuous batching with chunked prefill and preemption by recompute.

Each step: every decoding sequence gets one token (taking a new page when it crosses a page
boundary; when none is free, the most recently arrived running sequence is preempted: its
pages are freed and it re-enters the queue to be recomputed later). The remaining budget
(:class:`~lserve.engine.step_budget.StepBudget`: tokens, or measured time) goes to prefill
chunks, shortest remaining prompt first, over running sequences mid-prefill and waiting ones
alike: a short request that arrives during a long prefill is prefilled in the next step, and
the long one takes what is left (at least ``min_chunk`` tokens a step while it is first).

Prefix cache (:class:`~lserve.cache.prefix_cache.PrefixCache`): a waiting request starts its
prefill after the longest verified run of cached pages its prompt begins with (at most up to its
last token, which must be computed for logits); it takes a reference on those pages and its
streaming ring is filled from their shadows. Full prompt pages are indexed as soon as they are
written, so requests running at the same time share a prefix too, and a request whose next page
is being prefilled by a running one waits for it instead of computing it again; release drops
references instead of freeing cached pages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from lserve.cache.kv_cache import KVCache
from lserve.engine.sequence import Sequence, Status
from lserve.engine.step_budget import StepBudget


@dataclass
class Scheduled:
    """A sequence and the number of its tokens computed this step."""

    seq: Sequence
    num_tokens: int
    decode: bool


@dataclass(frozen=True)
class ChunkRule:
    """How a sequence's prefill chunks are cut in a step.

    ``align``: chunks end on multiples of it (0: anywhere, see :func:`aligned_chunk`); ``sparse``:
    its prefill is block-sparse, so a chunk costs the step budget's block-sparse attention
    (:meth:`~lserve.engine.step_budget.StepBudget.cost`)."""

    align: int = 0
    sparse: bool = False


def aligned_chunk(start: int, n: int, remaining: int, limit: int, align: int, nearest: bool = True) -> int:
    """``n`` (< ``remaining``) adjusted so that the chunk ends on a multiple of ``align``: on the
    nearer one, up only where ``limit`` allows it (or at the prompt's end), down only where that
    leaves tokens; ``n`` itself where neither works. ``nearest`` False (a step that carries decodes,
    whose time its budget bounds): down wherever that leaves tokens."""
    down = (start + n) // align * align
    up = min(remaining, down + align - start)
    if down > start and not nearest:
        return down - start
    if up <= limit and (down <= start or start + n - down >= align / 2):
        return up
    return down - start if down > start else n


class Scheduler:
    """Owns the waiting queue, the running set and all page allocation.

    ``chunk_rule(seq, decoding)``: the :class:`ChunkRule` of the sequence's chunks in a step that
    does (``decoding``) or does not carry decodes (None: anywhere, dense).
    """

    def __init__(self, cache: KVCache, max_num_seqs: int, budget: StepBudget, on_release,
                 chunk_rule: Callable[[Sequence, bool], ChunkRule] | None = None) -> None:
        self.cache = cache
        self.chunk_rule = chunk_rule
        self.max_num_seqs = max_num_seqs
        self.budget = budget  # its max_batched_tokens caps a step (decodes included)
        self.last_prefill_cost = 0.0  # token-equivalents of prefill the last schedule() picked
        self.on_release = on_release  # called with a seq_id whenever its pages are dropped
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- pages --------------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        self._index_prompt_pages(seq)
        if seq.dense_pages:
            self.cache.prefix.release(seq.dense_pages)
        if seq.stream_pages:
            self.cache.stream_alloc.free(seq.stream_pages)
        seq.dense_pages, seq.stream_pages = [], []
        seq.prefix_pages, seq.prefix_parent = 0, None
        self.on_release(seq.seq_id)

    def _index_prompt_pages(self, seq: Sequence) -> None:
        """Put the sequence's newly written full prompt pages into the prefix cache."""
        pc = self.cache.prefix
        full = min(seq.num_computed, len(seq.prompt_ids)) // self.cache.page_size
        if not (seq.cacheable and pc.enabled) or full <= seq.prefix_pages:
            return
        hashes = seq.page_hashes(pc)[:full]
        seq.prefix_parent = pc.insert(seq.prompt_ids, hashes, seq.dense_pages, seq.prefix_pages, seq.prefix_parent)
        seq.prefix_pages = full

    def _uses_cache(self, seq: Sequence) -> bool:
        return self.cache.prefix.enabled and seq.params.prefix_cache

    def _looks_up(self, seq: Sequence) -> bool:
        # prompt logprobs score every prompt token: none may come from the cache
        return self._uses_cache(seq) and seq.params.prompt_logprobs is None

    def _cached_run(self, seq: Sequence) -> list:
        """Cached entries a waiting ``seq`` would start from (its last token is always computed)."""
        if not self._looks_up(seq):
            return []
        N = self.cache.page_size
        most = min(len(seq.prompt_ids) // N, (seq.num_tokens - 1) // N)
        return self.cache.prefix.match(seq.prompt_ids, seq.page_hashes(self.cache.prefix), most)

    def _prefix_in_flight(self, seq: Sequence, have: int) -> bool:
        """Whether a running sequence is prefilling the page of ``seq``'s prompt after its ``have``
        cached ones: admitting ``seq`` now would compute that page (and those after it) twice."""
        if not self._looks_up(seq):
            return False
        pc, N = self.cache.prefix, self.cache.page_size
        mine = seq.page_hashes(pc)
        if have >= min(len(mine), (seq.num_tokens - 1) // N):
            return False
        for r in self.running:
            if r.cacheable and not r.in_decode and r.num_computed < (have + 1) * N:
                theirs = r.page_hashes(pc)
                if have < len(theirs) and theirs[have] == mine[have]:  # chained: the same prefix up to it
                    return True
        return False

    def _admit(self, seq: Sequence, n: int) -> int | None:
        """Give a waiting ``seq`` its cached prefix and pages for ``n`` more tokens; where its
        prefill starts, or None (nothing held) when pages are short.

        The match is redone here: an admission earlier in the same step may have evicted pages.
        """
        pc = self.cache.prefix
        hit = self._cached_run(seq)
        seq.dense_pages = pc.acquire(hit)
        seq.num_computed = len(hit) * self.cache.page_size
        if not self._grow(seq, seq.num_computed + n):
            pc.release(seq.dense_pages)
            seq.dense_pages, seq.num_computed = [], 0
            return None
        seq.cacheable = self._uses_cache(seq)
        seq.prefix_pages, seq.prefix_parent = len(hit), (hit[-1] if hit else None)
        if hit and seq.stream_pages:
            self.cache.fill_ring(seq.stream_pages, seq.dense_pages, seq.num_computed)
        if self._looks_up(seq):
            pc.stats.queries += len(seq.prompt_ids)
            pc.stats.hits += seq.num_computed
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed
        return seq.num_computed

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq`` hold ``num_tokens`` tokens; False (nothing taken) if pages are short."""
        need = self.cache.pages_for(num_tokens) - len(seq.dense_pages)
        ring = self.cache.stream_pages_per_seq if not seq.stream_pages else 0
        if not self.cache.dense_alloc.can_allocate(need) or not self.cache.stream_alloc.can_allocate(ring):
            return False
        if need > 0:
            seq.dense_pages += self.cache.dense_alloc.allocate(need)
        if ring:
            seq.stream_pages = self.cache.stream_alloc.allocate(ring)
        return True

    def reserve_next(self, seqs: list[Sequence]) -> bool:
        """Give each decoding sequence the pages for one token more than it has, without
        preempting (async decode schedules a step before the previous token is known).

        Returns False, taking nothing, when the dense pool is short.
        """
        need = [self.cache.pages_for(s.num_tokens + 1) - len(s.dense_pages) for s in seqs]
        if not self.cache.dense_alloc.can_allocate(sum(n for n in need if n > 0)):
            return False
        for seq, n in zip(seqs, need):
            if n > 0:
                seq.dense_pages += self.cache.dense_alloc.allocate(n)
        return True

    def finish(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.in_decode = False
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- the step -----------------------------------------------------------------------------
    def schedule(self) -> list[Scheduled]:
        out: list[Scheduled] = []
        # 1) decodes, oldest first; preempt the newest when pages run out.
        n_decode = 0
        for seq in sorted((s for s in self.running if s.in_decode), key=lambda s: s.arrival):
            if seq not in self.running:
                continue  # preempted below for an older sequence
            while not self._grow(seq, seq.num_tokens):
                victim = max(self.running, key=lambda s: s.arrival)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running and n_decode < self.budget.max_batched_tokens:
                out.append(Scheduled(seq, 1, True))
                n_decode += 1
        # 2) prefill chunks, shortest remaining prompt first (running mid-prefill and waiting).
        b = self.budget
        room = b.prefill_budget(n_decode)
        tokens_left = self.budget.max_batched_tokens - n_decode
        cost = 0.0
        for seq in self.running:  # pages the last step finished writing become shareable
            self._index_prompt_pages(seq)
        hits = {id(s): self._cached_run(s) for s in self.waiting}
        N = self.cache.page_size

        def start_of(s: Sequence) -> int:
            return len(hits[id(s)]) * N if s.status is Status.WAITING else s.num_computed

        pending = [s for s in self.running if not s.in_decode] + list(self.waiting)
        pending.sort(key=lambda s: (s.num_tokens - start_of(s), s.arrival))
        for seq in pending:
            if tokens_left <= 0:
                break
            start = start_of(seq)
            remaining = seq.num_tokens - start
            rule = self.chunk_rule(seq, n_decode > 0) if self.chunk_rule else ChunkRule()
            n = min(b.tokens_within(room - cost, start, remaining, rule.sparse), tokens_left)
            first = not out or all(item.decode for item in out)
            if first:  # the first prefill always progresses
                n = max(n, min(b.min_chunk, remaining, tokens_left))
            if rule.align and 0 < n < remaining:
                fits = n
                n = aligned_chunk(start, n, remaining, tokens_left, rule.align, nearest=not n_decode)
                if n_decode and n > fits and not first:
                    break  # a step with decodes goes past its budget for its first chunk only
            if n <= 0:
                break
            admit = seq.status is Status.WAITING
            if admit and len(self.running) >= self.max_num_seqs:
                continue
            if admit and self._prefix_in_flight(seq, len(hits[id(seq)])):
                continue  # wait for those pages: they will be cached in a step or a few
            if admit:
                start = self._admit(seq, n)
                if start is None:
                    break  # keep arrival order under memory pressure: no overtaking a blocked admission
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
            elif not self._grow(seq, start + n):
                continue
            out.append(Scheduled(seq, n, False))
            cost += b.cost(n, start, rule.sparse)
            tokens_left -= n
        self.last_prefill_cost = cost
        return out
