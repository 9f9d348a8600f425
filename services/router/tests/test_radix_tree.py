"""The prefix tree alone: matching per tenant, splitting edges, the global token budget and LRU eviction."""

from __future__ import annotations

import json
import random
import time
import tracemalloc
from array import array

import pytest

from rlfleet_router.radix_tree import NODE_TOKENS, RadixTree, token_key


def test_match_reports_the_longest_prefix_each_tenant_holds() -> None:
    tree = RadixTree(max_tokens=1000, node_tokens=0)
    tree.insert((1, 2, 3, 4, 5), "a")
    tree.insert((1, 2, 3, 9), "b")
    tree.insert((7, 8), "b")
    assert tree.match((1, 2, 3, 4, 5, 6)).matched == {"a": 5, "b": 3}
    assert tree.match((1, 2, 3, 9)).matched == {"a": 3, "b": 4}
    assert tree.match((1, 2)).matched == {"a": 2, "b": 2}, "a match may end inside an edge"
    assert tree.match((5,)).matched == {}
    assert tree.match((1, 2, 3, 4, 5)).best(["b", "a"]) == ("a", 5)
    assert tree.tokens == 5 + 1 + 2, "shared prefixes are stored once"


def test_match_tells_which_earlier_key_each_tenant_was_sent_that_this_one_continues() -> None:
    tree = RadixTree(max_tokens=1000, node_tokens=0)
    tree.insert((1, 2, 3, 4), "a")  # a conversation's first turn
    tree.insert((1, 2, 3, 4, 5, 6), "b")  # its next turn, sent elsewhere
    tree.insert((1, 2), "c")  # ends inside the edge a's key made: the edge is split there
    match = tree.match((1, 2, 3, 4, 5, 6, 7))
    assert match.matched == {"a": 4, "b": 6, "c": 2}
    assert match.extended == {"a": 4, "b": 6, "c": 2}
    # Holding a prefix is not having been sent it: a and b hold (1, 2, 3) but no key of theirs ended there.
    other = tree.match((1, 2, 3, 9))
    assert other.matched == {"a": 3, "b": 3, "c": 2} and other.extended == {"c": 2}
    assert tree.match((1, 2, 3, 4)).extended == {"a": 4, "c": 2}, "a key repeated whole is continued too"
    tree.remove_tenants(["c"])
    assert tree.match((1, 2, 3, 4, 5, 6, 7)).extended == {"a": 4, "b": 6}


def test_text_and_token_keys_live_side_by_side() -> None:
    tree = RadixTree(max_tokens=1000, node_tokens=0)
    tree.insert("You are a helpful assistant. 1+1=", "a")
    tree.insert((89, 111, 117), "b")
    assert tree.match("You are a helpful assistant. 2+2=").matched == {"a": 29}
    assert tree.match((89, 111, 117, 32)).matched == {"b": 3}


def test_least_recently_used_leaves_go_first() -> None:
    tree = RadixTree(max_tokens=12, node_tokens=0)
    tree.insert((1, 1, 1, 1), "a")
    tree.insert((2, 2, 2, 2), "a")
    tree.insert((3, 3, 3, 3), "a")
    tree.insert((1, 1, 1, 1), "b")  # touched again: now the most recent
    tree.insert((4, 4, 4, 4), "a")
    assert tree.tokens == 12 and tree.evictions == 1
    assert tree.match((2, 2, 2, 2)).matched == {}, "the oldest prefix was evicted"
    assert tree.match((1, 1, 1, 1)).matched == {"a": 4, "b": 4}
    assert tree.match((4, 4, 4, 4)).matched == {"a": 4}


def test_an_internal_node_becomes_evictable_once_its_children_are_gone() -> None:
    tree = RadixTree(max_tokens=10, node_tokens=0)
    tree.insert((1, 2, 3, 4), "a")
    tree.insert((1, 2, 5, 6), "a")  # splits: (1, 2) -> (3, 4), (5, 6)
    tree.insert((9, 9, 9, 9), "a")
    assert tree.tokens == 10 and tree.nodes == 4
    tree.insert((8, 8, 8, 8, 8, 8, 8), "a")  # needs 7: evicts (3, 4), (5, 6), then (1, 2), then (9, ...)
    assert tree.tokens == 7 and tree.match((8,) * 7).matched == {"a": 7}


def test_remove_tenant_drops_what_only_it_held() -> None:
    tree = RadixTree(max_tokens=100, node_tokens=0)
    tree.insert((1, 2, 3), "a")
    tree.insert((1, 2, 4), "b")
    tree.remove_tenants(["a"])
    assert tree.match((1, 2, 3)).matched == {"b": 2}
    assert tree.tokens == 3 and tree.nodes == 2


def test_a_million_distinct_prompts_stay_within_the_budget() -> None:
    budget = 100_000
    tree = RadixTree(max_tokens=budget)
    system_prompts = [tuple(range(s * 1000, s * 1000 + 48)) for s in range(8)]
    start = time.monotonic()
    for i in range(1_000_000):
        tree.insert((*system_prompts[i % 8], i, i >> 4, i >> 8), f"engine-{i % 16}")
        if i % 50_000 == 0:
            assert tree.used <= budget
    elapsed = time.monotonic() - start
    assert tree.used <= budget and tree.evictions > 900_000
    assert tree.match((*system_prompts[7], 999_999, 999_999 >> 4, 999_999 >> 8)).matched["engine-15"] == 51
    assert tree.match(system_prompts[0]).matched, "the hot shared prefixes survive eviction"
    assert elapsed < 30, f"1M inserts took {elapsed:.1f}s"


def test_several_tenants_go_in_one_walk_and_all_of_them_empty_the_tree() -> None:
    tree = RadixTree(max_tokens=100, node_tokens=0)
    tree.insert((1, 2, 3), "a")
    tree.insert((1, 2, 4), "b")
    tree.insert((1, 5), "c")
    tree.remove_tenants(["a", "c"])
    assert tree.match((1, 2, 3)).matched == {"b": 2} and tree.match((1, 5)).matched == {"b": 1}
    assert tree.tokens == 3 and tree.nodes == 3
    tree.remove_tenants(["b", "gone-before"])  # every tenant left: a fleet-wide flush
    assert tree.tokens == 0 and tree.nodes == 0 and tree.match((1, 2, 4)).matched == {}
    tree.insert((1, 2), "a")
    assert tree.match((1, 2, 4)).matched == {"a": 2}, "the emptied tree takes new keys"


def test_token_ids_in_any_sequence_meet_in_one_tree_and_are_copied_in() -> None:
    tree = RadixTree(max_tokens=100, node_tokens=0)
    tree.insert((1, 2, 3, 4), "a")
    tree.insert([1, 2, 5], "b")  # splits the edge the tuple made: both are stored as one type
    ids = token_key([1, 2, 3, 4, 6])
    tree.insert(ids, "c")
    ids[0] = 9  # the caller's array may change afterwards: the tree holds its own copy
    assert tree.match(array("i", [1, 2, 3, 4, 6])).matched == {"a": 4, "b": 2, "c": 5}
    assert tree.match((1, 2, 5)).extended == {"b": 3}
    assert tree.match(array("q", [1, 2, 3])).matched == {"a": 3, "b": 2, "c": 3}, "other typecodes are converted"
    assert tree.tokens == 4 + 1 + 1 and tree.nodes == 4


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1, 2**64, 1.5, "7", None])
def test_token_ids_beyond_32_bits_are_refused_and_leave_the_tree_as_it_was(bad: object) -> None:
    tree = RadixTree(max_tokens=100, node_tokens=0)
    tree.insert((1, 2, 3), "a")
    for call in (lambda: tree.insert((1, 2, bad), "b"), lambda: tree.match((1, 2, bad))):  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="32-bit"):
            call()
    assert tree.tokens == 3 and tree.nodes == 1 and tree.match((1, 2, 3)).matched == {"a": 3}
    assert list(token_key([-(2**31), 2**31 - 1])) == [-(2**31), 2**31 - 1], "the whole 32-bit range fits"


def test_a_stored_token_costs_a_few_bytes() -> None:
    """Long prompts fill the budget with tokens: at the default 2**24 the router's memory is this times 16 Mi. As
    tuples of the ints a JSON body parses into, a token cost about 37 bytes (650 MiB at the default); as 32-bit
    ints, 4 plus each node's share (about 0.8 KB a node: its dict, set, LRU entry)."""
    rng = random.Random(0)
    bodies = [json.dumps([rng.randrange(151_000) for _ in range(1000)]) for _ in range(100)]
    tree = RadixTree(max_tokens=2**24)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, body in enumerate(bodies):
            tree.insert(tuple(json.loads(body)), f"engine-{i % 4}")  # ints parsed per request, as the router does
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert tree.tokens == 100 * 1000
    assert held / tree.tokens < 8, f"{held / tree.tokens:.1f} bytes a stored token"


def test_prompts_parting_at_every_token_stay_within_the_budget_s_memory() -> None:
    """A node costs about 0.8 KB: counting tokens alone, prompts that part from each other at every token
    (a node a token) took 400 bytes a token, 6.4 GB at the default budget. Each node counts NODE_TOKENS."""
    budget = 2**20
    tree = RadixTree(max_tokens=budget)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(100_000):  # a trie of one-token edges: seven ways at each of the first six tokens
            tree.insert([i % 7, i // 7 % 7, i // 49 % 7, i // 343 % 7, i // 2401 % 7, i // 16807, i], "engine")
            assert i % 10_000 or tree.used <= budget
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert tree.used == tree.tokens + NODE_TOKENS * tree.nodes <= budget and tree.evictions > 0
    assert held / budget < 8, f"{held / budget:.1f} bytes a unit of the budget"
    assert tree.match([99_999 % 7, 99_999 // 7 % 7]).matched == {"engine": 2}, "the latest prompts stay"


def test_a_budget_must_hold_one_node() -> None:
    with pytest.raises(ValueError, match=f"above what one node costs \\({NODE_TOKENS}\\)"):
        RadixTree(max_tokens=NODE_TOKENS)
    tree = RadixTree(max_tokens=NODE_TOKENS + 3)
    tree.insert(list(range(10)), "engine")  # cut to what fits beside its node
    assert tree.tokens == 3 and tree.used == NODE_TOKENS + 3
