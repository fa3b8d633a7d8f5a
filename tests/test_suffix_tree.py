"""The suffix tree against a naive rescan of the sequences it holds, and the
bounds of the namespace output trees."""
import gc
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.spec.drafters import Drafters
from agentkv.spec.suffix import NodeBudget, OutputTree, OutputTrees, SuffixDrafter
from agentkv.spec.suffix_tree import SuffixTree

VOCAB = 3


class Naive:
    """Counts by rescanning every sequence; recency by replaying the tree's
    rule (a substring's stamp is the clock of its latest append, and it is
    forgotten when its last occurrence goes). Drafts walk to the child
    stamped last, with count-ratio probabilities."""

    def __init__(self, depth: int):
        self.depth = depth
        self.seqs: dict[int, list[int]] = {}
        self.stamps: dict[tuple, int] = {}
        self.clock = itertools.count(1)

    def extend(self, key, tokens):
        seq = self.seqs.setdefault(key, [])
        for t in tokens:
            seq.append(t)
            now = next(self.clock)
            for d in range(1, min(self.depth, len(seq)) + 1):
                self.stamps[tuple(seq[-d:])] = now

    def truncate(self, key, n):
        seq = self.seqs[key]
        while len(seq) > n:
            ends = [tuple(seq[-d:]) for d in range(1, min(self.depth, len(seq)) + 1)]
            seq.pop()
            for sub in ends:
                if self.count(sub) == 0:
                    del self.stamps[sub]

    def drop_front(self, key, n):
        seq = self.seqs[key]
        for _ in range(n):
            starts = [tuple(seq[:d]) for d in range(1, min(self.depth, len(seq)) + 1)]
            seq.pop(0)
            for sub in starts:
                if self.count(sub) == 0:
                    del self.stamps[sub]

    def count(self, sub: tuple) -> int:
        n = len(sub)
        return sum(tuple(s[i : i + n]) == sub for s in self.seqs.values() for i in range(len(s) - n + 1))

    def substrings(self) -> set[tuple]:
        return {tuple(s[i : i + d]) for s in self.seqs.values() for d in range(1, self.depth + 1)
                for i in range(len(s) - d + 1)}

    def speculate(self, pattern, max_tokens, factor, min_prob, discount=0, newest=True):
        best = ([], 0.0, 0)
        for m in range(1, min(len(pattern), self.depth) + 1):
            cur = tuple(pattern[-m:])
            if self.count(cur) == 0:
                break
            toks, probs, prob, disc = [], [], 1.0, discount
            while len(toks) < min(max_tokens, int(m * factor + 1e-6)) and len(cur) < self.depth:
                kids = {t: self.count(cur + (t,)) for t in range(VOCAB)}
                kids = {t: c for t, c in kids.items() if c}
                if not kids:
                    break
                t = max(kids, key=lambda t: (0 if newest else kids[t], self.stamps[cur + (t,)]))
                p = prob * kids[t] / (self.count(cur) - disc)
                disc = 0
                if p < min_prob:
                    break
                prob, cur = p, cur + (t,)
                toks.append(t)
                probs.append(prob)
            if toks and sum(probs) >= best[1]:
                best = (toks, sum(probs), m)
        return best


seqs = st.integers(0, 2)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("extend"), seqs, st.lists(st.integers(0, VOCAB - 1), max_size=8)),
        st.tuples(st.just("truncate"), seqs, st.floats(0, 1)),
        st.tuples(st.just("remove"), seqs, st.none()),
        st.tuples(st.just("drop_front"), seqs, st.floats(0, 1)),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(depth=st.integers(1, 6), ops=ops, probe=st.lists(st.integers(0, VOCAB - 1), max_size=7),
       max_tokens=st.integers(0, 6), factor=st.sampled_from([0.5, 1.0, 2.0]), min_prob=st.sampled_from([0.05, 0.3, 0.6]),
       newest=st.booleans())
def test_matches_naive_rescan(depth, ops, probe, max_tokens, factor, min_prob, newest):
    tree, ref = SuffixTree(depth), Naive(depth)
    for op, key, arg in ops:
        if op == "extend":
            tree.extend(key, arg)
            ref.extend(key, arg)
        elif key in ref.seqs:
            if op == "truncate":
                cut = int(arg * len(ref.seqs[key]))
                tree.truncate(key, cut)
                ref.truncate(key, cut)
            elif op == "drop_front":
                cut = int(arg * len(ref.seqs[key]))
                tree.drop_front(key, cut)
                ref.drop_front(key, cut)
            else:
                tree.remove(key)
                ref.truncate(key, 0)
                del ref.seqs[key]
        assert tree.num_tokens == sum(map(len, ref.seqs.values()))
        # Exactly one node per distinct substring within the depth: nothing leaks.
        assert tree.num_nodes == len(ref.substrings())
    for sub in ref.substrings():
        assert tree.count(sub) == ref.count(sub)
        assert tree.continuations(sub) == {t: ref.count(sub + (t,)) for t in range(VOCAB)
                                           if len(sub) < depth and ref.count(sub + (t,))}
    got = tree.speculate(probe, max_tokens, factor, min_prob, newest)
    want = ref.speculate(probe, max_tokens, factor, min_prob, newest=newest)
    assert (got.tokens, got.match_len) == want[::2]
    assert got.score == pytest.approx(want[1])
    for key, seq in ref.seqs.items():
        end = tree.speculate_end(key, max_tokens, factor, min_prob, newest)
        want = ref.speculate(seq[-depth:], max_tokens, factor, min_prob, discount=1, newest=newest)
        assert (end.tokens, end.match_len) == want[::2]


def test_truncate_restores_the_tree_exactly():
    tree = SuffixTree(4)
    tree.extend("a", [0, 1, 2, 0, 1])
    before = {sub: tree.count(sub) for sub in [(0,), (0, 1), (0, 1, 2), (1, 2, 0, 1)]}
    nodes = tree.num_nodes
    tree.extend("a", [2, 0, 1, 1, 1, 1])
    tree.truncate("a", 5)
    assert tree.num_nodes == nodes
    assert {sub: tree.count(sub) for sub in before} == before
    assert tree.speculate([0, 1], 4).tokens == [2, 0]  # as before the detour
    tree.remove("a")
    assert tree.num_nodes == tree.num_tokens == len(tree) == 0


def test_drafts_the_newest_continuation_scored_by_frequency_and_bounded_by_the_match():
    tree = SuffixTree(8)
    tree.extend(0, [5, 1, 2, 3, 5, 1, 2, 3, 5, 1, 9, 4])
    # After 5 1: "2 3" twice, then "9 4" once, the newest: estimated 1/3.
    d = tree.speculate([7, 5, 1], 8)
    assert d.tokens == [9, 4] and d.match_len == 2
    assert d.probs == pytest.approx([1 / 3, 1 / 3])
    assert tree.speculate([7, 5, 1], 8, min_prob=0.5).tokens == []  # too unsure
    assert tree.speculate([2], 8, max_factor=2.0).tokens == [3, 5]  # a match of 1 drafts up to 2
    assert tree.speculate([2], 8, max_factor=1.0).tokens == [3]
    assert tree.speculate([7, 5, 1], 8, newest=False).tokens == [2, 3]  # SuffixDecoding's: the most frequent


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        SuffixTree(0)
    tree = SuffixTree(3)
    tree.extend(0, [1, 2])
    with pytest.raises(ValueError):
        tree.truncate(0, 3)
    with pytest.raises(ValueError):
        tree.count([1, 2, 3, 4])
    with pytest.raises(ValueError):
        OutputTree(max_tokens=0)
    with pytest.raises(ValueError):
        Drafters("eagle")


def test_output_tree_is_bounded_and_evicts_least_recently_used():
    out = OutputTree(max_depth=6, max_tokens=40)
    for i in range(10):
        out.add([100 + i] * 2 + [1, 2, 3, 4, 5, 6])
        assert out.tree.num_tokens <= 40
    assert len(out) == 5 and out.evicted == 5
    # The oldest kept is output 5; a draft from it, once accepted, keeps it.
    drafter = SuffixDrafter(out)
    drafter.extend([105, 105])
    assert drafter.propose(2) == [1, 2]
    drafter.record(2, 2)
    out.add([200] * 8)
    assert drafter.propose(2) == [1, 2]  # 6 went instead of 5
    assert out.speculate([106, 106], 2, 1.0, 0.1).tokens == []
    # An output longer than the whole budget keeps its end.
    out.add(list(range(300, 400)))
    assert out.tree.num_tokens == 40 and len(out) == 1


def test_output_tree_bounds_its_nodes():
    out = OutputTree(max_depth=4, max_nodes=60)
    for i in range(20):
        out.add([10 * i + j for j in range(6)])  # nothing shared: 4 + 4 + 4 + 3 + 2 + 1 nodes each
        assert out.tree.num_nodes <= 60
    assert len(out) == 3 and out.tree.num_nodes == 54


def test_output_trees_are_per_namespace_and_bounded():
    trees = OutputTrees(max_tokens=100, max_namespaces=2)
    trees.get("a").add([1, 2, 3])
    assert trees.get("b").tree.num_tokens == 0
    trees.get("c")
    assert trees.get("a").tree.num_tokens == 0  # "a" was the least recently used: gone


def test_a_tenant_cycling_cache_salts_evicts_only_its_own_output_history():
    # Issue 42: at most max_namespaces trees in all, so a tenant cycling
    # cache_salt (a namespace each) erased every other tenant's history.
    trees = OutputTrees(max_tokens=100, max_namespaces=2, owner=lambda ns: ns.split(":", 1)[0])
    trees.get("alice").add([1, 2, 3])
    for salt in range(5):
        trees.get(f"mallory:{salt}").add([4, 5])
    assert trees.get("alice").tree.num_tokens == 3
    assert trees.get("mallory:4").tree.num_tokens == 2 and trees.get("mallory:0").tree.num_tokens == 0


def test_session_history_and_outputs_never_mix_namespaces():
    drafters = Drafters("suffix")
    drafters.finished("tenant-a", [7, 8, 9, 10, 11, 12])
    b = drafters.new("tenant-b")
    b.extend([1, 7, 8, 9])
    assert b.propose(4) == []
    a = drafters.new("tenant-a")
    a.extend([1, 7, 8, 9])
    assert a.propose(3) == [10, 11, 12]


def test_suffix_drafter_prefers_the_better_scoring_tree_and_adapts():
    out = OutputTree()
    out.add([1, 2, 3, 4, 5, 6, 7, 8])
    out.add([1, 2, 3, 4, 5, 6, 7, 8])
    d = SuffixDrafter(out, max_k=4)
    # The session saw 1 2 3 followed by 0 once and by 4 9 once; the outputs
    # twice by 4 5 6: surer, so theirs.
    d.extend([1, 2, 3, 0, 1, 2, 3, 4, 9, 1, 2, 3])
    assert d.propose() == [4, 5, 6, 7]  # max_k
    assert d.from_outputs == 1
    d.record(4, 0)
    assert d.draft_len == 2
    d.truncate(4)
    assert d.tokens == [1, 2, 3, 0]
    assert d.draft_len == 2
    assert d.propose(4) == []  # the only occurrence of "0" is the end itself


windows = st.lists(
    st.one_of(st.tuples(st.just("extend"), st.lists(st.integers(0, VOCAB - 1), max_size=10)),
              st.tuples(st.just("truncate"), st.floats(0, 1))),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(window=st.integers(1, 12), ops=windows)
def test_session_tree_holds_a_bounded_window_of_the_history(window, ops):
    d = SuffixDrafter(max_depth=4, window=window)
    history: list[int] = []
    truncated = False
    for op, arg in ops:
        if op == "extend":
            d.extend(arg)
            history += arg
        else:
            cut = int(arg * len(history))
            d.truncate(cut)
            del history[cut:]
            truncated = True
        held = d.tree.sequence(0)
        assert d.tokens == history and len(d) == len(history)
        assert len(held) <= window and held == history[len(history) - len(held) :]
        if not truncated:  # a cut within the window leaves it short until it fills again
            assert len(held) == min(window, len(history))
        # Exactly the counts and nodes of a tree built over the window afresh.
        fresh = SuffixTree(4)
        fresh.extend(0, held)
        assert d.tree.num_nodes == fresh.num_nodes and d.tree.num_tokens == len(held)
        subs = {tuple(held[i : i + n]) for n in range(1, 5) for i in range(len(held) - n + 1)}
        assert all(d.tree.count(sub) == fresh.count(sub) for sub in subs)


def test_a_long_session_keeps_its_tree_within_the_window():
    d = SuffixDrafter(window=256)
    d.extend(list(range(1000, 1200)) * 10)  # 2000 tokens, one repeating span
    assert len(d) == 2000 and d.tree.num_tokens == 256
    assert d.tree.num_nodes <= 256 * d.tree.max_depth
    d.extend([1000, 1001, 1002])
    assert d.propose(4) == [1003, 1004, 1005, 1006]  # still drafts from the window
    d.truncate(10)  # below the window: indexed again from the history
    assert d.tokens == list(range(1000, 1010)) and d.tree.sequence(0) == d.tokens


def test_session_trees_share_one_node_budget_cut_least_recent_first():
    budget = NodeBudget(max_nodes=500)
    a, b = SuffixDrafter(max_depth=4, budget=budget), SuffixDrafter(max_depth=4, budget=budget)
    a.extend(list(range(100)))  # nothing repeats: n + (n-1) + (n-2) + (n-3) nodes
    assert budget.total == a.tree.num_nodes == 394 and budget.shrunk == 0
    b.extend(list(range(200, 260)))  # 234 more: a, the least recent, loses its older half
    assert budget.total == a.tree.num_nodes + b.tree.num_nodes == 194 + 234 and budget.shrunk == 1
    assert a.tokens == list(range(100))  # the history stays whole
    assert a.tree.sequence(0) == list(range(50, 100))  # its recent end kept
    b.extend(list(range(300, 400)))  # a is emptied first, then b cuts itself
    assert a.tree.num_tokens == 0 and b.tree.num_tokens == 80 and b.tree.sequence(0)[-1] == 399
    assert budget.total == b.tree.num_nodes == 314
    del a
    gc.collect()
    assert len(budget) == 1 and budget.total == b.tree.num_nodes  # a's nodes went with it
    d = Drafters("suffix", max_session_nodes=1000)
    sessions = [d.new("ns") for _ in range(20)]
    for i, s in enumerate(sessions):
        s.extend([1000 * i + j for j in range(100)])
    assert d.session_nodes.total <= 1000 and sum(s.tree.num_nodes for s in sessions) == d.session_nodes.total
    with pytest.raises(ValueError):
        NodeBudget(0)


def test_nodes_give_the_garbage_collector_nothing_to_walk():
    # A server's trees hold millions of nodes: as objects the collector tracks,
    # every full collection walked them all (20% of the scheduler's time in a
    # 12-agent run). Their count of tracked objects must not grow with the nodes.
    gc.collect()
    before = len(gc.get_objects())
    tree = SuffixTree(24)
    tree.extend(0, list(range(2000)))  # nothing repeats: ~24 nodes a token
    tree.drop_front(0, 500)
    tree.truncate(0, 1000)
    gc.collect()
    assert tree.num_nodes > 20_000
    assert len(gc.get_objects()) - before < 100
