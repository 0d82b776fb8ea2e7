"""The routing policy on its own: prefix hashing, affinity, imbalance fallback, load ranking."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lserve.serve.router import PrefixAffinityPolicy, ReplicaLoad, prefix_hashes, routing_text

A = "You are a careful assistant. Here is a long shared document. " * 20  # ~1200 chars
B = "Completely different context about the history of bridges in Europe. " * 20


def loads(**tokens: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(rid, kv_tokens=t) for rid, t in tokens.items()]


def test_prefix_hashes_chain_and_share_exactly_the_common_prefix():
    h1 = prefix_hashes(A + "question one? " * 10, 64)
    h2 = prefix_hashes(A + "another, longer question two? " * 10, 64)
    assert len(h1) == len(A + "question one? " * 10) // 64
    common = len(A) // 64
    assert h1[:common] == h2[:common]
    assert h1[common] != h2[common]  # the block that straddles the divergence differs
    assert prefix_hashes("x" * 63, 64) == []  # partial blocks are not hashed
    assert prefix_hashes(A, 64, max_blocks=3) == prefix_hashes(A, 64)[:3]
    # a change in the first block changes every hash (chained)
    h3 = prefix_hashes("Z" + A[1:], 64)
    assert not set(h3) & set(prefix_hashes(A, 64))


def test_prefix_hashes_are_stable_across_processes():
    code = "from lserve.serve.router import prefix_hashes; print(prefix_hashes('abc' * 50, 16))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == str(prefix_hashes("abc" * 50, 16))


def test_routing_text_is_prefix_preserving_for_chats_and_token_ids():
    sys_msg = {"role": "system", "content": A}
    t1 = routing_text([sys_msg, {"role": "user", "content": "q1"}])
    t2 = routing_text([sys_msg, {"role": "user", "content": "q2"}, {"role": "assistant", "content": "x"}])
    assert t1[:len(A)] == t2[:len(A)]
    assert routing_text([1, 2, 3]).startswith(routing_text([1, 2]))
    assert not routing_text([1, 23]).startswith(routing_text([1, 2]))  # ids are delimited
    assert routing_text("plain") == "plain"


def test_same_long_prefix_goes_to_the_replica_that_served_it():
    p = PrefixAffinityPolicy(min_prefix_blocks=2, imbalance_tokens=1000, imbalance_ratio=2.0)
    pa = prefix_hashes(A + "q1", 64)
    first = p.decide(pa, loads(r1=0, r2=0))
    assert first.reason == "load" and set(first.ranked) == {"r1", "r2"}
    chosen = first.ranked[0]
    p.record(pa, chosen)
    other = "r2" if chosen == "r1" else "r1"
    # the holder is busier than the other replica, but within the allowed imbalance
    d = p.decide(prefix_hashes(A + "q2 is different", 64), loads(**{chosen: 800, other: 0}))
    assert d.reason == "prefix" and d.ranked == [chosen, other]
    assert d.matched_blocks == len(A) // 64 and d.holder == chosen


def test_overloaded_holder_falls_back_to_least_loaded():
    p = PrefixAffinityPolicy(min_prefix_blocks=2, imbalance_tokens=1000, imbalance_ratio=2.0)
    pa = prefix_hashes(A, 64)
    p.record(pa, "r1")
    # threshold: 2.0 * 500 + 1000 = 2000
    assert p.decide(pa, loads(r1=2000, r2=500, r3=900)).ranked[0] == "r1"
    d = p.decide(pa, loads(r1=2001, r2=500, r3=900))
    assert d.reason == "imbalance" and d.ranked == ["r2", "r3", "r1"] and d.holder == "r1"


def test_short_matches_do_not_count_and_unknown_prefixes_rank_by_load():
    p = PrefixAffinityPolicy(min_prefix_blocks=4, imbalance_tokens=10_000)
    short = prefix_hashes(A[:64 * 3], 64)
    p.record(short, "r1")
    d = p.decide(short, loads(r1=100, r2=50, r3=70))
    assert d.reason == "load" and d.matched_blocks == 3 and d.ranked == ["r2", "r3", "r1"]
    d = p.decide(prefix_hashes(B, 64), loads(r1=100, r2=50, r3=70))
    assert d.reason == "load" and d.matched_blocks == 0 and d.ranked == ["r2", "r3", "r1"]
    # loads are token loads: queued prompt tokens + KV tokens + tokens sent since the last report
    mixed = [ReplicaLoad("r1", queued_prompt_tokens=300), ReplicaLoad("r2", kv_tokens=200),
             ReplicaLoad("r3", pending_tokens=100, kv_tokens=150)]
    assert p.decide([], mixed).ranked == ["r2", "r3", "r1"]


def test_not_by_request_counts_a_replica_with_few_long_requests_is_busier():
    p = PrefixAffinityPolicy()
    # r1 runs 1 request holding 6000 KV tokens; r2 runs 10 short ones holding 640
    busy = [ReplicaLoad("r1", kv_tokens=6000), ReplicaLoad("r2", kv_tokens=640)]
    assert p.decide([], busy).ranked == ["r2", "r1"]


def test_longest_match_wins_among_holders():
    p = PrefixAffinityPolicy(min_prefix_blocks=2, imbalance_tokens=10_000)
    doc = prefix_hashes(A + B, 64)
    p.record(doc[:10], "r1")  # r1 saw only the first 10 blocks
    p.record(doc, "r2")       # r2 saw the whole document
    d = p.decide(doc, loads(r1=0, r2=500))
    assert d.ranked[0] == "r2" and d.matched_blocks == len(doc)
    # a request sharing only the first 10 blocks: both hold them, the less loaded one wins
    d = p.decide(doc[:10], loads(r1=0, r2=500))
    assert d.ranked[0] == "r1" and d.reason == "prefix"


def test_dead_replicas_rank_last_and_forgotten_replicas_lose_their_prefixes():
    p = PrefixAffinityPolicy(min_prefix_blocks=1, imbalance_tokens=10_000)
    pa = prefix_hashes(A, 64)
    p.record(pa, "r1")
    dead = [ReplicaLoad("r1", alive=False), ReplicaLoad("r2", kv_tokens=5000)]
    assert p.decide(pa, dead).ranked == ["r2", "r1"]
    p.forget("r1")
    assert len(p) == 0
    assert p.decide(pa, loads(r1=0, r2=0)).reason == "load"
    assert p.decide(pa, []).ranked == []


def test_table_is_bounded_lru():
    p = PrefixAffinityPolicy(min_prefix_blocks=1, max_entries=50)
    pa, pb = prefix_hashes(A, 16), prefix_hashes(B, 16)
    assert len(pa) > 50 and len(pb) > 50
    p.record(pa, "r1")
    assert len(p) == 50  # only the most recent hashes stay: the deepest blocks of A
    p.record(pb, "r2")
    assert p.longest_match(pa, {"r1", "r2"})[0] == 0  # A's first block was evicted


def test_new_prefixes_spread_over_equally_loaded_replicas():
    p = PrefixAffinityPolicy()
    firsts = {p.decide(prefix_hashes(f"document number {i} " * 40, 64), loads(r1=0, r2=0, r3=0)).ranked[0]
              for i in range(30)}
    assert firsts == {"r1", "r2", "r3"}


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError):
        PrefixAffinityPolicy(imbalance_ratio=0.5)
    with pytest.raises(ValueError):
        prefix_hashes("abc", 0)
