import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.spec.ngram import NGramDrafter


def naive_propose(history: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Rescan the whole history: longest n first, most recent earlier end first."""
    end = len(history)
    for n in range(max_n, min_n - 1, -1):
        if n > end:
            continue
        suffix = history[end - n :]
        for e in range(end - 1, n - 1, -1):
            if history[e - n : e] == suffix:
                return history[e : e + k]
    return []


tokens = st.lists(st.integers(0, 3), max_size=8)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("extend"), tokens),
        st.tuples(st.just("truncate"), st.floats(0, 1)),
        st.tuples(st.just("propose"), st.integers(0, 10)),
    ),
    max_size=40,
)
sizes = st.tuples(st.integers(1, 5), st.integers(0, 3)).map(lambda t: (t[0] + t[1], t[0]))


@settings(max_examples=300, deadline=None)
@given(sizes=sizes, ops=ops)
def test_matches_naive_rescan_under_extend_truncate_propose(sizes, ops):
    max_n, min_n = sizes
    drafter = NGramDrafter(max_n=max_n, min_n=min_n)
    history: list[int] = []
    for op, arg in ops:
        if op == "extend":
            drafter.extend(arg)
            history += arg
        elif op == "truncate":
            cut = int(arg * len(history))
            drafter.truncate(cut)
            del history[cut:]
        else:
            assert drafter.propose(arg) == naive_propose(history, arg, max_n, min_n)
        assert len(drafter) == len(history)
        assert drafter.propose(10) == naive_propose(history, 10, max_n, min_n)


@settings(max_examples=200, deadline=None)
@given(history=st.lists(st.integers(0, 3), max_size=30), cut=st.floats(0, 1), more=tokens, after=tokens)
def test_truncate_then_extend_equals_fresh(history, cut, more, after):
    n = int(cut * len(history))
    rolled = NGramDrafter()
    rolled.extend(history)
    rolled.truncate(n)
    rolled.extend(more)
    fresh = NGramDrafter()
    fresh.extend(history[:n] + more)
    # Internal state too: a rollback must leave no stale ends or empty stacks.
    assert rolled._tokens == fresh._tokens
    assert rolled._ends == fresh._ends
    for token in after:
        rolled.extend([token])
        fresh.extend([token])
        assert rolled.propose(8) == fresh.propose(8)


def test_proposes_what_followed_the_most_recent_occurrence():
    d = NGramDrafter(max_n=3, min_n=1)
    d.extend([7, 1, 2, 3, 9, 9, 1, 2, 4, 5, 1, 2])
    # (1, 2) occurred twice before the suffix; the later one was followed by 4 5.
    assert d.propose(3) == [4, 5, 1]
    # Fewer than k when the history runs out.
    assert d.propose(10) == [4, 5, 1, 2]


def test_longer_match_beats_more_recent_shorter_one():
    d = NGramDrafter(max_n=3, min_n=1)
    d.extend([1, 2, 3, 8, 5, 2, 3, 9, 1, 2, 3])
    assert d.propose(1) == [8]


def test_the_suffix_itself_is_not_a_match_but_an_overlapping_one_is():
    d = NGramDrafter(max_n=4)
    d.extend([1, 2, 3])
    assert d.propose(4) == []
    d.extend([1, 2, 1, 2])
    assert d.propose(4) == [1, 2]


def test_min_n_excludes_short_matches():
    d = NGramDrafter(max_n=3, min_n=2)
    d.extend([5, 1, 6, 5])
    assert d.propose(2) == []
    d.extend([1])
    assert d.propose(2) == [6, 5]


def test_draft_length_shrinks_on_rejection_probes_and_recovers():
    d = NGramDrafter(max_k=8, probe_every=16)
    d.extend([1, 2, 3, 1, 2])
    assert d.draft_len == 8
    for expected in (4, 2, 1, 0):
        d.record(d.draft_len, 0)
        assert d.draft_len == expected
    # Nothing is drafted while at zero, even with a match available...
    assert d.propose() == []
    d.extend([3] * 15)
    assert d.draft_len == 0
    # ...until enough tokens have gone by for a one-token probe.
    d.extend([1, 2])
    assert d.draft_len == 1
    assert d.propose() == [3]
    for expected in (2, 4, 8, 8):
        d.record(d.draft_len, d.draft_len)
        assert d.draft_len == expected
    d.record(8, 3)
    assert d.draft_len == 4
    # A probe that fails goes back to sleep for another probe_every tokens.
    for _ in range(3):
        d.record(d.draft_len, 0)
    assert d.draft_len == 0
    d.extend([0] * 16)
    d.record(d.draft_len, 0)
    assert d.draft_len == 0


def test_a_short_fully_accepted_draft_does_not_shrink_the_length():
    d = NGramDrafter(max_k=8)
    d.record(2, 2)
    assert d.draft_len == 8


def test_truncate_rewinds_the_probe_clock():
    d = NGramDrafter(probe_every=4)
    d.extend([1] * 10)
    for _ in range(4):
        d.record(max(d.draft_len, 1), 0)
    d.truncate(5)
    d.extend([1] * 3)
    assert d.draft_len == 0
    d.extend([1])
    assert d.draft_len == 1


def test_counters():
    d = NGramDrafter()
    assert d.mean_accepted == 0.0
    d.record(4, 4)
    d.record(8, 2)
    d.record(3, 0)
    assert (d.drafted, d.accepted, d.verify_steps) == (15, 6, 3)
    assert d.mean_accepted == 2.0


def test_argument_errors():
    with pytest.raises(ValueError, match="min_n"):
        NGramDrafter(max_n=2, min_n=3)
    with pytest.raises(ValueError, match="max_k"):
        NGramDrafter(max_k=0)
    d = NGramDrafter()
    d.extend([1, 2])
    with pytest.raises(ValueError, match="truncate"):
        d.truncate(3)
    with pytest.raises(ValueError, match="k must"):
        d.propose(-1)
    for drafted, accepted in ((0, 0), (2, 3), (2, -1)):
        with pytest.raises(ValueError, match="accepted"):
            d.record(drafted, accepted)


def test_long_history_costs_index_operations_per_token_not_per_history():
    rng = random.Random(0)
    vocab = list(range(200))
    spans = [[rng.choice(vocab) for _ in range(30)] for _ in range(50)]
    history: list[int] = []
    while len(history) < 50_000:
        # Mostly fresh text, some of it copied spans, as in a tool-calling trace.
        history += rng.choice(spans) if rng.random() < 0.3 else [rng.choice(vocab) for _ in range(20)]
    d = NGramDrafter()
    d.extend(history)
    grams_per_token = d.max_n - d.min_n + 1
    assert d.index_ops <= grams_per_token * len(history)

    before = d.index_ops
    hits = 0
    for step in range(2_000):
        proposal = d.propose(8)
        hits += bool(proposal)
        if step % 200 == 0:
            assert proposal == naive_propose(history, 8, d.max_n, d.min_n)
        token = rng.choice(vocab)
        d.extend([token])
        history.append(token)
        if step % 100 == 99:
            d.truncate(len(d) - 3)
            del history[-3:]
    ops = d.index_ops - before
    # Each step: one lookup per n, one push per n, and the rolled-back pops.
    assert ops <= 2_000 * 2 * grams_per_token + 20 * 3 * grams_per_token
    assert hits > 1_000
