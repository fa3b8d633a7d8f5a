"""The replay's budget arithmetic (experiments.workloads.replay_budget):
distinct tokens against a naive set of prefixes, the footprint of a hand
example, budgets in whole blocks."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.experiments.workloads.replay_budget import budget_tokens, replay_footprint, trie_size


def naive_trie_size(seqs: list[list[int]]) -> int:
    """Every distinct non-empty prefix is one trie node."""
    return len({tuple(s[:i]) for s in seqs for i in range(1, len(s) + 1)})


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=12))
def test_trie_size_counts_every_distinct_prefix_once(seqs):
    assert trie_size(seqs) == naive_trie_size(seqs)


def test_shared_heads_and_repeated_histories_count_once():
    head = list(range(100))
    a1, a2 = head + [1000, 1001], head + [1000, 1001, 1002, 1003]  # agent a's two requests
    b1 = head + [2000]
    assert trie_size([a1, a2, b1]) == 100 + 4 + 1
    fp = replay_footprint({"a": [a1, a2], "b": [b1]}, max_tokens=10)
    # Prompts' union, plus one reply per agent in flight.
    assert fp["distinct_tokens"] == 105 + 2 * 10
    # Each agent's largest prompt and its reply, nothing shared.
    assert fp["working_set_tokens"] == (104 + 10) + (101 + 10)
    assert fp["shared_tokens"] == fp["working_set_tokens"] - fp["distinct_tokens"] == 100
    assert fp["longest_request_tokens"] == 114
    assert fp["requests"] == 3 and fp["prompt_tokens"] == 102 + 104 + 101


def test_budgets_are_whole_blocks_of_the_distinct_tokens():
    fp = {"distinct_tokens": 10_000, "longest_request_tokens": 2_000}
    assert budget_tokens(fp, 0.25, 128) == 2432  # 2500 rounded down to 19 blocks
    assert budget_tokens(fp, 0.5, 16) == 4992  # 312 whole pages of 16
    assert budget_tokens(fp, 1.0, 128) == 9984


def test_a_budget_below_the_longest_request_is_refused():
    fp = {"distinct_tokens": 10_000, "longest_request_tokens": 2_500}
    with pytest.raises(ValueError, match="longest request"):
        budget_tokens(fp, 0.25, 128)
    with pytest.raises(ValueError, match="positive"):
        budget_tokens(fp, 0.0, 128)
