"""Routing policy: prefix affinity balanced against token load (pure Python, no Ray).

A request is described by chained hashes of its prompt's blocks: the full token pages the
engine's prefix cache indexes (:mod:`lserve.serve.prefix_keys`), or, before the ingress has a
tokenizer, fixed-size text blocks (:func:`prefix_hashes`). Block ``i``'s hash covers blocks
``0..i``, so two prompts share a hash exactly when they share that whole prefix.
:class:`PrefixAffinityPolicy` remembers which replica recently served each hash and prefers
the replica holding the longest matching prefix, unless that replica's token load (prompt
tokens queued + KV tokens in use + tokens routed to it since its last report) is too far above
the least-loaded replica's; then, as for prompts with no known prefix, replicas are ranked by
load. Ties are broken by rendezvous hashing on the prompt's first block, so new prefixes spread
over replicas deterministically.

:mod:`lserve.serve.ray_router` plugs this policy into Ray Serve's request-router interface.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Most blocks hashed per prompt (longer prompts are matched on this many leading blocks).
MAX_BLOCKS = 4096

# Request routers alive in this process (one per deployment handle). Kept here, not in
# lserve.serve.ray_router: Ray Serve ships a custom router's module by value, so globals there
# would be private copies.
_ROUTERS: weakref.WeakSet = weakref.WeakSet()


def register_router(router) -> None:
    """Record a live request router (anything with ``app_name`` and ``curr_replicas``)."""
    _ROUTERS.add(router)


def routers_for(app_name: str) -> list:
    """The registered routers of application ``app_name`` in this process."""
    return [r for r in list(_ROUTERS) if r.app_name == app_name]


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def routing_text(prompt: str | Sequence[int] | Sequence[Mapping]) -> str:
    """A prefix-preserving text form of a prompt: text as is, token ids, or chat messages.

    Two prompts that start the same way (same leading tokens, same leading chat turns) give
    texts that start the same way.
    """
    if isinstance(prompt, str):
        return prompt
    parts = []
    for item in prompt:
        if isinstance(item, Mapping):
            parts.append(f"\x1e{item.get('role', '')}\x1f{item.get('content', '')}")
        else:
            parts.append(f"{int(item)},")
    return "".join(parts)


def prefix_hashes(text: str, block_chars: int, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Chained 64-bit hashes of the complete ``block_chars``-character blocks of ``text``.

    Parameters
    ----------
    text : str
        The prompt in :func:`routing_text` form.
    block_chars : int
        Block length; a trailing partial block is not hashed.
    max_blocks : int
        At most this many leading blocks are hashed.

    Returns
    -------
    list of int
        ``h[i]`` identifies ``text[: (i + 1) * block_chars]``. Stable across processes (BLAKE2b,
        never the salted builtin ``hash``).
    """
    if block_chars < 1:
        raise ValueError(f"block_chars must be >= 1, got {block_chars}")
    out: list[int] = []
    prev = b""
    for i in range(min(len(text) // block_chars, max_blocks)):
        block = text[i * block_chars:(i + 1) * block_chars].encode("utf-8", "surrogatepass")
        digest = hashlib.blake2b(prev + block, digest_size=8).digest()
        out.append(int.from_bytes(digest, "big"))
        prev = digest
    return out


@dataclass
class ReplicaLoad:
    """What the router knows about one replica's load, in tokens.

    Parameters
    ----------
    replica_id : str
    queued_prompt_tokens : int
        Prompt tokens of requests the replica has accepted but not prefilled yet.
    kv_tokens : int
        KV cache in use (dense pages used times the page size).
    pending_tokens : int
        Prompt tokens this router sent to the replica after its last report (less the prefix it
        was known to cache).
    alive : bool
        False when the replica reported a dead engine (it is ranked last).
    """

    replica_id: str
    queued_prompt_tokens: int = 0
    kv_tokens: int = 0
    pending_tokens: int = 0
    alive: bool = True

    @property
    def tokens(self) -> int:
        """Total token load."""
        return self.queued_prompt_tokens + self.kv_tokens + self.pending_tokens


@dataclass
class RouteDecision:
    """A ranking of replicas, best first, and why the first one was chosen.

    ``reason`` is ``"prefix"`` (longest known prefix, load acceptable), ``"imbalance"`` (the prefix
    holder was overloaded, least-loaded first instead), ``"load"`` (no usable prefix match) or
    ``"none"`` (no live replicas). ``matched_blocks`` is the length of the best prefix match found and
    ``holder`` the replica holding it (when the match is long enough to count).
    """

    ranked: list[str]
    reason: str
    matched_blocks: int = 0
    holder: str | None = None


class PrefixAffinityPolicy:
    """Prefix affinity balanced against token load.

    Parameters
    ----------
    min_prefix_blocks : int
        A match shorter than this many blocks does not count (only long prefixes stick).
    imbalance_tokens, imbalance_ratio : float
        The prefix holder ``r`` keeps the request only while
        ``load(r) <= imbalance_ratio * min_load + imbalance_tokens``, where ``min_load`` is the
        least-loaded live replica's load; otherwise the least-loaded replica comes first.
    max_entries : int
        Prefix-table size (least recently used hashes are dropped first).
    holders_per_prefix : int
        Replicas remembered per hash (most recent first).
    """

    def __init__(self, min_prefix_blocks: int = 2, imbalance_tokens: float = 2048, imbalance_ratio: float = 2.0,
                 max_entries: int = 200_000, holders_per_prefix: int = 4) -> None:
        if min_prefix_blocks < 1 or imbalance_tokens < 0 or imbalance_ratio < 1 or max_entries < 1:
            raise ValueError("need min_prefix_blocks >= 1, imbalance_tokens >= 0, imbalance_ratio >= 1, max_entries >= 1")
        self.min_prefix_blocks = min_prefix_blocks
        self.imbalance_tokens = imbalance_tokens
        self.imbalance_ratio = imbalance_ratio
        self.max_entries = max_entries
        self.holders_per_prefix = holders_per_prefix
        self._table: OrderedDict[int, list[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    # -- state --------------------------------------------------------------------------------
    def record(self, prefix: Sequence[int], replica_id: str) -> None:
        """Remember that ``replica_id`` now serves (and caches) the prompt with these block hashes."""
        for h in prefix:
            holders = self._table.pop(h, [])
            if replica_id in holders:
                holders.remove(replica_id)
            holders.insert(0, replica_id)
            del holders[self.holders_per_prefix:]
            self._table[h] = holders
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        """Drop a replica (it died or was scaled away) from the prefix table."""
        for h in list(self._table):
            holders = self._table[h]
            if replica_id in holders:
                holders.remove(replica_id)
                if not holders:
                    del self._table[h]

    def drop(self, hashes: Sequence[int], replica_id: str) -> None:
        """``replica_id`` no longer holds these prefixes (its cache evicted their pages)."""
        for h in hashes:
            holders = self._table.get(h)
            if holders and replica_id in holders:
                holders.remove(replica_id)
                if not holders:
                    del self._table[h]

    def longest_match(self, prefix: Sequence[int], replica_ids: set[str]) -> tuple[int, list[str]]:
        """Length (in blocks) of the longest known prefix held by one of ``replica_ids``, and its holders."""
        best: tuple[int, list[str]] = (0, [])
        for i, h in enumerate(prefix):
            holders = [r for r in self._table.get(h, ()) if r in replica_ids]
            if not holders:
                break
            best = (i + 1, holders)
        return best

    # -- decisions ----------------------------------------------------------------------------
    def overloaded(self, load: float, min_load: float) -> bool:
        """Whether a replica with ``load`` tokens is too busy next to the least-loaded one."""
        return load > self.imbalance_ratio * min_load + self.imbalance_tokens

    def decide(self, prefix: Sequence[int], loads: Sequence[ReplicaLoad], tokens: int = 0,
               block_tokens: int = 0) -> RouteDecision:
        """Rank replicas for a request whose prompt has block hashes ``prefix``.

        Parameters
        ----------
        prefix : sequence of int
            Block hashes of the prompt (may be empty).
        loads : sequence of ReplicaLoad
            The candidate replicas.
        tokens, block_tokens : int
            The prompt's tokens and the tokens per block. The imbalance check then weighs what the
            request itself costs where it goes: only its unmatched tokens on the prefix holder,
            all of them elsewhere (0: the loads alone).

        Returns
        -------
        RouteDecision
            Every candidate, best first; dead replicas last.
        """
        if not loads:
            return RouteDecision([], "none")
        seed = prefix[0].to_bytes(8, "big") if prefix else b""
        tie = {r.replica_id: _h64(seed + r.replica_id.encode()) for r in loads}
        live = [r for r in loads if r.alive]
        dead = sorted((r for r in loads if not r.alive), key=lambda r: (r.tokens, tie[r.replica_id]))
        by_load = sorted(live, key=lambda r: (r.tokens, tie[r.replica_id]))
        if not by_load:
            return RouteDecision([r.replica_id for r in dead], "none")
        min_load = by_load[0].tokens
        load_of = {r.replica_id: r.tokens for r in live}
        matched, holders = self.longest_match(prefix, set(load_of))
        reason, first, holder = "load", None, None
        if matched >= self.min_prefix_blocks:
            holder = min(holders, key=lambda r: (load_of[r], tie[r]))
            cached = min(tokens, matched * block_tokens)
            if not self.overloaded(load_of[holder] + tokens - cached, min_load + tokens):
                reason, first = "prefix", holder
            else:
                reason = "imbalance"
        ranked = [first] if first else []
        ranked += [r.replica_id for r in by_load if r.replica_id != first]
        ranked += [r.replica_id for r in dead]
        return RouteDecision(ranked, reason, matched, holder)
