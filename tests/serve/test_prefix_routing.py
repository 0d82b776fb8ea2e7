"""Router affinity on the engine's own prefix-cache keys, and forgetting evicted prefixes."""

from __future__ import annotations

from types import SimpleNamespace

from lserve.serve.prefix_keys import PrefixKeys
from lserve.serve.ray_router import PrefixAwareRequestRouter
from lserve.serve.router import PrefixAffinityPolicy, ReplicaLoad
from lserve.serve.settings import ServeSettings

DOC = "The router keys prefixes on the same token pages the engine caches. " * 30


def test_route_keys_are_the_engines_page_hashes(smol):
    from lserve.config import CacheConfig, EngineConfig
    from lserve.engine import LLMEngine

    settings = ServeSettings(page_size=16, logical_page_size=4)
    keys = PrefixKeys(settings, load=False)
    keys.tokenizer = smol.tokenizer
    route = keys.route(DOC + " Q1?")
    assert route["keys"] == "pages"
    cfg = settings.engine_config()
    eng = LLMEngine(EngineConfig(model="default", cache=CacheConfig(page_size=16, logical_page_size=4, dense_pool_tokens=512),
                                 sparsity=cfg.sparsity, prefix_cache=True), smol)
    # The engine's seed comes from its own config; the settings' config differs only in fields
    # that are not part of the seed (max tokens), so the keys agree.
    assert eng.cache.prefix.seed == keys.seed
    ids = eng.encode_prompt(DOC + " Q1?")
    assert route["prefix"] == eng.cache.prefix.hashes(ids) and len(route["prefix"]) == len(ids) // 16
    assert route["tokens"] == len(ids)
    chat = keys.route([{"role": "user", "content": DOC}], chat=True)
    assert chat["tokens"] == len(eng.encode_prompt([{"role": "user", "content": DOC}]))


def test_keys_fall_back_to_characters_without_a_tokenizer():
    keys = PrefixKeys(ServeSettings(), load=False)
    route = keys.route(DOC)
    assert route["keys"] == "chars" and len(route["prefix"]) == len(DOC) // keys.block_chars


def test_policy_drops_evicted_prefixes_of_one_replica():
    p = PrefixAffinityPolicy(min_prefix_blocks=2)
    p.record([1, 2, 3], "a")
    p.record([1, 2, 3], "b")
    p.drop([2, 3], "a")
    assert p.longest_match([1, 2, 3], {"a"}) == (1, ["a"])
    assert p.longest_match([1, 2, 3], {"a", "b"}) == (3, ["b"])


def _router() -> PrefixAwareRequestRouter:
    r = object.__new__(PrefixAwareRequestRouter)  # Ray builds it with its own arguments; the state is ours
    r.initialize_state(min_prefix_blocks=2)
    return r


def _replica(rid: str, **stats) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats=stats)


def test_router_forgets_what_a_replica_reports_evicted():
    r = _router()
    r.policy.record([1, 2, 3], "a")
    r._sync_replicas([_replica("a", ts=10.0, prefix_evictions=0)])
    assert r.policy.longest_match([1, 2, 3], {"a"})[0] == 3
    r._sync_replicas([_replica("a", ts=11.0, prefix_evictions=1, prefix_evicted=[3])])
    assert r.policy.longest_match([1, 2, 3], {"a"})[0] == 2
    # A router that missed more than the reported window forgets the replica's prefixes entirely.
    r._sync_replicas([_replica("a", ts=200.0, prefix_evictions=5, prefix_evicted=[])])
    assert r.policy.longest_match([1, 2, 3], {"a"})[0] == 0
    d = r.policy.decide([1, 2, 3], [ReplicaLoad("a"), ReplicaLoad("b")])
    assert d.reason == "load"


def test_router_forgets_a_replica_whose_report_lists_fewer_evictions_than_happened():
    r = _router()
    r.policy.record([1, 2, 3], "a")
    r.policy.record([7, 8, 9], "a")
    r._sync_replicas([_replica("a", ts=10.0, prefix_evictions=1, prefix_evicted=[3])])
    assert r.policy.longest_match([1, 2, 3], {"a"})[0] == 2
    r.policy.record([1, 2, 3], "a")  # the document was sent there again: its last page is cached anew
    # Two new evictions; the report still repeats the older one: only the newest two count.
    r._sync_replicas([_replica("a", ts=11.0, prefix_evictions=3, prefix_evicted=[3, 9, 8])])
    assert r.policy.longest_match([1, 2, 3], {"a"})[0] == 3
    assert r.policy.longest_match([7, 8, 9], {"a"})[0] == 1
    # A capped report (fewer hashes than evictions since the last read): the router cannot know which.
    r._sync_replicas([_replica("a", ts=12.0, prefix_evictions=10, prefix_evicted=[5, 6])])
    assert r.policy.longest_match([1, 2, 3], {"a"})[0] == 0


def test_imbalance_weighs_what_the_request_costs_on_each_replica():
    p = PrefixAffinityPolicy(min_prefix_blocks=2, imbalance_tokens=1000, imbalance_ratio=2.0)
    p.record(list(range(30)), "a")  # a caches 30 blocks of 64 tokens
    busy = [ReplicaLoad("a", kv_tokens=3000), ReplicaLoad("b")]
    assert p.decide(list(range(31)), busy).reason == "imbalance"  # the loads alone: 3000 > 2 * 0 + 1000
    # 2000 prompt tokens, 1920 of them cached on a: 3000 + 80 <= 2 * (0 + 2000) + 1000
    d = p.decide(list(range(31)), busy, tokens=2000, block_tokens=64)
    assert d.reason == "prefix" and d.ranked[0] == "a"
    assert p.decide(list(range(31)), [ReplicaLoad("a", kv_tokens=6000), ReplicaLoad("b")], 2000, 64).reason \
        == "imbalance"
