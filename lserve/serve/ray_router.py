"""Ray Serve request router that applies :class:`~lserve.serve.router.PrefixAffinityPolicy`.

It runs inside each caller of the engine deployment (the ingress), sees every handle call, and:

* for ``generate`` calls made with ``lserve_route={"prefix": [...], "tokens": n}``, ranks replicas
  by prefix affinity and token load. Load is what each replica last reported through
  ``record_routing_stats`` (``queued_prompt_tokens``, ``kv_tokens``, ``alive``, ``ts``) plus the
  prompt tokens this router sent it since that report;
* forgets prefixes a replica reports its prefix cache evicted (``prefix_evicted`` in its routing
  stats), so affinity follows the pages that are really there;
* for calls made with ``lserve_target=<replica id>`` (admin and drill calls), picks that replica;
* for anything else, ranks by load alone.

Replicas are matched to requests by Ray's internal request id (no FIFO mixin), so every request
gets the replica chosen for it. Calls made while serving one HTTP request share that id, so the
ingress issues them one at a time. A full first choice falls through to the next rank (Ray Serve's own queue-length check), and
``should_backoff`` is set so an all-full deployment waits instead of spinning.
"""

from __future__ import annotations

import time
from collections import deque

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from lserve.serve.router import PrefixAffinityPolicy, ReplicaLoad, RouteDecision, register_router

ROUTE_KWARG = "lserve_route"
TARGET_KWARG = "lserve_target"


class PrefixAwareRequestRouter(RequestRouter):
    """Prefix-affinity, token-load-aware replica ranking for the engine deployment.

    ``request_router_kwargs`` are passed to :meth:`initialize_state`.
    """

    def initialize_state(self, min_prefix_blocks: int = 2, imbalance_tokens: float = 2048,
                         imbalance_ratio: float = 2.0, max_entries: int = 200_000, **_: object) -> None:
        """Build the policy (called by Ray Serve with ``request_router_kwargs``)."""
        self.policy = PrefixAffinityPolicy(min_prefix_blocks, imbalance_tokens, imbalance_ratio, max_entries)
        # (internal request id, replica unique id) -> [(prompt tokens, wall time sent), ...]; calls made
        # while serving one HTTP request share the internal id (n > 1 choices), hence the lists.
        self._inflight: dict[tuple[str, str], list[tuple[int, float]]] = {}
        self._known: set[str] = set()
        self._evictions_seen: dict[str, tuple[float, int]] = {}  # replica -> (report time, evictions) applied
        self.decisions: deque[tuple[float, str, RouteDecision]] = deque(maxlen=256)
        register_router(self)

    # -- load ---------------------------------------------------------------------------------
    def replica_loads(self, candidates: list[RunningReplica]) -> list[ReplicaLoad]:
        """Current token load of each candidate: its last report plus what was sent after it."""
        loads = []
        for r in candidates:
            rid = r.replica_id.unique_id
            stats = r.routing_stats or {}
            ts = float(stats.get("ts", 0.0))
            pending = sum(tok for (_, dest), sent_list in self._inflight.items() if dest == rid
                          for tok, sent in sent_list if sent >= ts)
            loads.append(ReplicaLoad(rid, int(stats.get("queued_prompt_tokens", 0)), int(stats.get("kv_tokens", 0)),
                                     pending, bool(stats.get("alive", True))))
        return loads

    def _sync_replicas(self, candidates: list[RunningReplica]) -> None:
        ids = {r.replica_id.unique_id for r in candidates}
        for gone in self._known - ids:
            self.policy.forget(gone)
            self._evictions_seen.pop(gone, None)
        self._known = ids
        for r in candidates:
            self._apply_evictions(r.replica_id.unique_id, r.routing_stats or {})

    def _apply_evictions(self, rid: str, stats: dict) -> None:
        """Forget the prefixes a replica reported evicted. Its report lists only its newest
        evictions (a bounded number, newest last) beside a running count; when more pages were
        evicted since this router's last read than the report lists, it cannot know which: it
        forgets the replica's prefixes (a lost hit, never a belief in a page that is gone)."""
        ts = float(stats.get("ts", 0.0))
        total = int(stats.get("prefix_evictions", 0))
        seen_ts, seen_total = self._evictions_seen.get(rid, (0.0, 0))
        if ts <= seen_ts:
            return
        new = total - seen_total
        if new > 0:
            listed = list(stats.get("prefix_evicted") or [])
            if new > len(listed):
                self.policy.forget(rid)
            else:
                self.policy.drop(listed[-new:], rid)
        self._evictions_seen[rid] = (ts, total)

    # -- the Ray interface --------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranked groups of one replica each, best first."""
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        self._sync_replicas(candidate_replicas)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get(TARGET_KWARG)
        if target is not None:
            return [[by_id[target]]] if target in by_id else []
        route = kwargs.get(ROUTE_KWARG) or {}
        decision = self.policy.decide(route.get("prefix") or [], self.replica_loads(candidate_replicas),
                                      int(route.get("tokens", 0)), int(route.get("block_tokens", 0)))
        if route:
            self.decisions.append((time.time(), decision.ranked[0] if decision.ranked else "", decision))
        return [[by_id[rid]] for rid in decision.ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        """Count the request against its replica until that replica reports again; remember its prefix."""
        route = pending_request.kwargs.get(ROUTE_KWARG)
        if not route:
            return
        rid = replica_id.unique_id
        prefix = route.get("prefix") or []
        # what the replica will compute: the prompt less the prefix it (as far as we know) caches
        matched = self.policy.longest_match(prefix, {rid})[0]
        tokens = int(route.get("tokens", 0))
        tokens = max(1, tokens - matched * int(route.get("block_tokens", 0))) if tokens else 0
        self.policy.record(prefix, rid)
        key = (pending_request.metadata.internal_request_id, rid)
        self._inflight.setdefault(key, []).append((tokens, time.time()))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Forget a finished request's pending tokens."""
        key = (internal_request_id, replica_id.unique_id)
        sent = self._inflight.get(key)
        if sent:
            sent.pop(0)
            if not sent:
                del self._inflight[key]
