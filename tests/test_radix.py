"""The radix prefix cache, with no model: the KV tensor itself is the ground truth.

"Computing" a sequence writes, at each position i, K = (token, i) and
V = (fingerprint of tokens[:i + 1], 0): like real KV, a slot's content depends
on the whole prefix, so a page reused for the wrong prefix shows.
"""
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from agentkv.cache.block_table import BlockTable
from agentkv.cache.errors import KVCapacityError
from agentkv.cache.pool import PagePool
from agentkv.cache.radix import RadixCache

NAMESPACES = ("a", "b")
MAX_LEN = 32
MAX_SESSIONS = 4


def make_pool(num_pages: int = 32, page_size: int = 4) -> PagePool:
    return PagePool(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=num_pages, page_size=page_size)


def expected_kv(tokens: list[int]) -> torch.Tensor:
    """[2 (K, V), len(tokens), head_dim 2]"""
    fingerprints, h = [], 0
    for t in tokens:
        h = (h * 31 + t + 1) % 16_777_213  # below 2**24: exact in fp32
        fingerprints.append(h)
    out = torch.zeros(2, len(tokens), 2)
    out[0, :, 0] = torch.tensor(tokens, dtype=torch.float32)
    out[0, :, 1] = torch.arange(len(tokens), dtype=torch.float32)
    out[1, :, 0] = torch.tensor(fingerprints, dtype=torch.float32)
    return out


def _page_slots(pool: PagePool, pages: list[int], start: int, end: int, first_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    ps = pool.page_size
    page = torch.tensor([pages[i // ps - first_index] for i in range(start, end)], dtype=torch.long)
    return page, torch.arange(start, end) % ps


def read_kv(pool: PagePool, pages: list[int], end: int, start: int = 0, first_index: int = 0) -> torch.Tensor:
    """KV of positions [start, end); pages[0] is page index first_index."""
    page, slot = _page_slots(pool, pages, start, end, first_index)
    return torch.stack([pool.kv[0, kv, :, :, 0, :][page, slot] for kv in (0, 1)])


def append(pool: PagePool, table: BlockTable, tokens: list[int], new: list[int]) -> None:
    """Compute new after tokens (whose KV table holds): copy-on-write, write, advance."""
    for src, dst in table.reserve(len(new)):
        pool.kv[:, :, dst] = pool.kv[:, :, src]
    tokens.extend(new)
    page, slot = _page_slots(pool, table.pages, table.length, len(tokens), 0)
    values = expected_kv(tokens)[:, table.length :]
    for kv in (0, 1):
        pool.kv[0, kv, :, :, 0, :][page, slot] = values[kv]
    table.advance(len(new))


def compute(pool: PagePool, tokens: list[int]) -> BlockTable:
    table = BlockTable(pool)
    append(pool, table, [], list(tokens))
    return table


def publish(pool: PagePool, cache: RadixCache, tokens: list[int], namespace: str = "default") -> list[int]:
    """Compute tokens from scratch, insert them, keep no session: the tree is the only holder."""
    table = compute(pool, tokens)
    pages = list(table.pages)
    cache.insert(tokens, pages, namespace)
    table.release()
    return pages


def assert_matches(pool: PagePool, pages: list[int], tokens: list[int], length: int) -> None:
    assert len(pages) == -(-length // pool.page_size)
    assert torch.equal(read_kv(pool, pages, length), expected_kv(tokens[:length]))


# White-box views of the tree, for the property test's reference and invariants.


def tree_nodes(cache: RadixCache) -> Iterator[tuple[str, tuple[int, ...], Any]]:
    """(namespace, tokens from the root to the node's end, node) for every node."""
    for namespace, root in cache._roots.items():
        stack = [(root, ())]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                child_path = path + tuple(child.key)
                yield namespace, child_path, child
                stack.append((child, child_path))


def cached_prefixes(cache: RadixCache) -> dict[str, set[tuple[int, ...]]]:
    out = {ns: {()} for ns in NAMESPACES}
    for namespace, path, _ in tree_nodes(cache):
        out[namespace].update(path[:i] for i in range(1, len(path) + 1))
    return out


def check_node_pages(cache: RadixCache) -> None:
    """Every node's pages hold its path's KV, including the positions before its
    start in a first page shared by index with its parent."""
    pool, ps = cache.pool, cache.pool.page_size
    for _, path, node in tree_nodes(cache):
        start, end = len(path) - len(node.key), len(path)
        assert (node.start, node.end) == (start, end)
        assert len(node.pages) == (end - 1) // ps - start // ps + 1
        got = read_kv(pool, node.pages, end, start=start // ps * ps, first_index=start // ps)
        assert torch.equal(got, expected_kv(list(path))[:, start // ps * ps :])


def leaves(cache: RadixCache) -> list[tuple[str, tuple[int, ...], Any]]:
    return [(ns, path, node) for ns, path, node in tree_nodes(cache) if not node.children]


# Unit tests.


def test_match_ending_mid_page_then_divergent_append_copies_and_owner_is_unchanged():
    pool = make_pool(page_size=4)
    cache = RadixCache(pool)
    owner_tokens = list(range(10))
    owner = compute(pool, owner_tokens)
    cache.insert(owner_tokens, owner.pages)

    query = owner_tokens[:6] + [50, 51, 52]
    length, pages = cache.match(query)
    assert (length, pages) == (6, owner.pages[:2])
    assert_matches(pool, pages, query, length)
    session, tokens = BlockTable(pool, pages, length), query[:length]
    append(pool, session, tokens, query[length:])

    assert session.pages[0] == owner.pages[0] and session.pages[1] != owner.pages[1]  # copied, not written
    assert torch.equal(read_kv(pool, session.pages, 9), expected_kv(query))
    assert torch.equal(read_kv(pool, owner.pages, 10), expected_kv(owner_tokens))
    assert cache.insert(query, session.pages) == 3
    for seq, table in ((owner_tokens, owner), (query, session)):
        length, pages = cache.match(seq)
        assert (length, pages) == (len(seq), table.pages)
        assert_matches(pool, pages, seq, length)
        pool.decref(pages)
    owner.release()
    session.release()
    cache.clear()


def test_split_at_unaligned_position_gives_the_shared_page_index_to_both_halves():
    pool = make_pool(page_size=4)
    cache = RadixCache(pool)
    x = list(range(10))
    y = x[:6] + [20, 21, 22, 23]
    xp = publish(pool, cache, x)
    yp = publish(pool, cache, y)  # diverges at 6, inside page index 1

    assert sorted(cache.held_pages()) == sorted([xp[0], xp[1], xp[1], xp[2], yp[1], yp[2]])
    assert pool.refcount[yp[0]] == 0  # y's copy of the cached part is not kept
    assert (cache.num_nodes, cache.cached_tokens, cache.cached_pages) == (3, 14, 5)
    for seq, want in ((x, (10, xp)), (y, (10, [xp[0], yp[1], yp[2]])), (x[:6] + [30], (6, xp[:2]))):
        length, pages = cache.match(seq)
        assert (length, pages) == want
        assert_matches(pool, pages, seq, length)
        pool.decref(pages)
    # y is now more recent: x's lower half goes first, its page 1 staying with the upper half.
    pool.decref(cache.match(y)[1])
    assert cache.evict(1) == 1 and pool.refcount[xp[2]] == 0 and pool.refcount[xp[1]] == 1
    assert cache.evict(1) == 2  # y's leaf
    assert cache.evict(1) == 2  # the upper half, a leaf now
    assert pool.num_free == pool.num_pages and cache.num_nodes == 0


def test_eviction_takes_least_recently_used_leaves_first_then_their_parents():
    pool = make_pool(page_size=4)
    cache = RadixCache(pool)
    a, b, c = [0] * 4 + [1] * 4, [0] * 4 + [2] * 4, [3] * 8
    for seq in (a, b, c):
        publish(pool, cache, seq)
    pool.decref(cache.match(a)[1])

    def cached() -> set[tuple[int, ...]]:
        return {path for _, path, _ in leaves(cache)}

    assert cache.evict(1) == 1 and cached() == {tuple(a), tuple(c)}  # b's leaf holds one page
    assert cache.evict(1) == 2 and cached() == {tuple(a)}  # c
    assert cache.evict(1) == 1 and cached() == {(0,) * 4}  # a's leaf; the parent is a leaf now
    assert cache.evict(5) == 1 and cached() == set()
    assert cache.evict(5) == 0
    assert cache.evicted_pages == 5 and pool.num_free == pool.num_pages


def test_eviction_keeps_what_a_session_pins_and_frees_the_rest_of_its_leaf():
    """A session that holds only a leaf's first page pins that page: the
    leaf's other pages still go (split on the page boundary)."""
    pool = make_pool(page_size=4)
    cache = RadixCache(pool)
    pinned, idle = [1] * 12, [2] * 12
    publish(pool, cache, pinned)
    publish(pool, cache, idle)
    length, pages = cache.match(pinned[:2])  # the session holds only the first of the leaf's pages
    session = BlockTable(pool, pages, length)
    pool.decref(cache.match(idle)[1])  # the pinned leaf is the least recently used one

    assert cache.evict(100) == 5  # the idle leaf's 3 pages and the pinned one's last 2
    check_node_pages(cache)
    length, pages = cache.match(pinned)
    assert length == 4
    assert_matches(pool, pages, pinned, length)
    pool.decref(pages)
    assert cache.match(idle)[0] == 0
    assert cache.evict(100) == 0  # what the session holds stays
    session.release()
    assert cache.evict(100) == 1 and pool.num_free == pool.num_pages


def test_eviction_keeps_the_pages_asked_for_then_frees_them_when_asked_again():
    """keep (a waiting request's prefix) pins a leaf for that call only: the
    rest goes first, the kept leaf's pages past the last kept one too."""
    pool = make_pool(page_size=4)
    cache = RadixCache(pool)
    wanted, other = [1] * 12, [2] * 8
    kept = publish(pool, cache, wanted)
    publish(pool, cache, other)
    pool.decref(cache.match(other)[1])  # the wanted leaf is the least recently used one

    assert cache.evict(100, keep=frozenset(kept[:2])) == 3  # other's 2 pages, the wanted leaf's last one
    check_node_pages(cache)
    length, pages = cache.match(wanted)
    assert length == 8 and pages == kept[:2]
    assert_matches(pool, pages, wanted, length)
    pool.decref(pages)
    assert cache.match(other)[0] == 0
    assert cache.evict(100, keep=frozenset(kept[:2])) == 0
    assert cache.evict(100) == 2 and pool.num_free == pool.num_pages


def test_a_match_never_crosses_namespaces():
    pool = make_pool(page_size=8)
    cache = RadixCache(pool)
    tokens = list(range(12))
    in_a = publish(pool, cache, tokens, "a")
    assert cache.match(tokens, "b") == (0, [])
    assert cache.match(tokens) == (0, [])
    in_b = publish(pool, cache, tokens, "b")
    for namespace, want in (("a", in_a), ("b", in_b)):
        length, pages = cache.match(tokens, namespace)
        assert (length, pages) == (12, want)
        pool.decref(pages)
    assert set(in_a).isdisjoint(in_b)


def test_counters():
    pool = make_pool(page_size=4)
    cache = RadixCache(pool)
    seq = list(range(10))
    pages = publish(pool, cache, seq)
    assert cache.insert(seq[:7], pages[:2]) == 0  # a prefix of what is cached
    pool.decref(cache.match(seq[:5] + [99])[1])
    cache.match([99])
    pool.decref(cache.match(seq)[1])
    assert cache.stats() == {
        "hits": 2, "misses": 1, "matched_tokens": 15, "inserted_tokens": 10, "evicted_pages": 0,
        "cached_tokens": 10, "cached_pages": 3, "num_nodes": 1,
    }
    cache.evict(1)
    assert cache.stats()["evicted_pages"] == 3 and cache.stats()["cached_pages"] == 0
    with pytest.raises(ValueError):
        cache.insert(seq, [0])


def test_peek_is_what_match_gives_without_taking_references_or_counting():
    pool = make_pool(page_size=4)
    cache = RadixCache(pool)
    seq = list(range(10))
    publish(pool, cache, seq)
    publish(pool, cache, seq[:6] + [50, 51, 52])
    refs = list(pool.refcount)
    for query in (seq, seq[:6] + [50, 99], seq[:3], [99], seq + [1, 2]):
        stats = cache.stats()
        peeked = cache.peek(query)
        assert pool.refcount == refs and cache.stats() == stats
        length, pages = cache.match(query)
        pool.decref(pages)
        assert peeked == (length, pages)
    assert cache.peek(seq, namespace="other") == (0, [])


def test_clear_and_a_dropped_tree_give_every_page_back():
    pool = make_pool(page_size=4)
    cache = RadixCache(pool)
    publish(pool, cache, list(range(9)))
    cache.clear()
    assert pool.num_free == pool.num_pages and cache.match(list(range(9))) == (0, [])
    cache = RadixCache(pool)
    publish(pool, cache, list(range(9)))
    del cache
    assert pool.num_free == pool.num_pages


# The property test.


@dataclass
class Session:
    table: BlockTable
    tokens: list[int]
    namespace: str


def longest_prefix(cached: set[tuple[int, ...]], tokens: list[int]) -> int:
    return max(n for n in range(len(tokens) + 1) if tuple(tokens[:n]) in cached)


sequence_specs = st.tuples(st.integers(0, 63), st.integers(0, 6), st.lists(st.integers(0, 2), max_size=12))
namespaces = st.sampled_from(NAMESPACES)
indices = st.integers(0, 63)


class RadixMachine(RuleBasedStateMachine):
    """Sessions, inserts, matches and evictions against a reference: per
    namespace, the prefix-closed set of cached token tuples."""

    @initialize(
        page_size=st.sampled_from([4, 8]),
        num_pages=st.integers(12, 32),
        system=st.lists(st.integers(0, 2), max_size=20),
    )
    def setup(self, page_size, num_pages, system):
        self.pool = make_pool(num_pages, page_size)
        self.cache = RadixCache(self.pool)
        self.reference = {ns: {()} for ns in NAMESPACES}
        self.counts = dict.fromkeys(("hits", "misses", "matched_tokens", "inserted_tokens", "evicted_pages"), 0)
        self.sessions: list[Session] = []
        self.corpus: dict[str, list[list[int]]] = {ns: [[]] for ns in NAMESPACES}
        # A system prompt every tenant starts from, so that the tree is not
        # empty in runs where hypothesis disables the inserting rules.
        for namespace in NAMESPACES:
            self.insert_fresh((0, 0, system), namespace)

    def sequence(self, spec, namespace: str) -> list[int]:
        """An extension of a prefix of something seen before: prefixes get shared
        and diverge at arbitrary positions, mid-page included. Hypothesis favours
        small numbers, so they count from the recent end of things."""
        back, drop, extension = spec
        corpus = self.corpus[namespace]
        base = corpus[-1 - back % len(corpus)]
        return (base[: max(len(base) - drop, 0)] + extension)[:MAX_LEN]

    def evict(self, num_pages: int) -> int:
        session_pages = {p for s in self.sessions for p in s.table.pages}
        ps = self.pool.page_size
        # What a session holds stays: each node's tokens up to the end of its last page a session holds.
        pinned = [(ns, path[: min(node.end, (node.start // ps + max(i for i, p in enumerate(node.pages)
                                                                    if p in session_pages) + 1) * ps)])
                  for ns, path, node in tree_nodes(self.cache) if session_pages.intersection(node.pages)]
        free = self.pool.num_free
        freed = self.cache.evict(num_pages)
        self.counts["evicted_pages"] += freed
        assert self.pool.num_free - free == freed
        after = cached_prefixes(self.cache)
        for ns in NAMESPACES:
            assert after[ns] <= self.reference[ns]
        assert all(path in after[ns] for ns, path in pinned)
        if freed < num_pages:  # only pinned leaves may be left
            assert all(session_pages.intersection(node.pages) for _, _, node in leaves(self.cache))
        self.reference = after
        return freed

    def append(self, session: Session, new: list[int]) -> bool:
        """Compute new into the session, evicting under memory pressure as the engine would."""
        needed = session.table.pages_needed(len(new))
        if needed > self.pool.num_free:
            self.evict(needed - self.pool.num_free)
        try:
            append(self.pool, session.table, session.tokens, new)
        except KVCapacityError:
            return False
        return True

    def insert(self, tokens: list[int], pages: list[int], namespace: str) -> None:
        cached = self.reference[namespace]
        new = len(tokens) - longest_prefix(cached, tokens)
        assert self.cache.insert(tokens, pages, namespace) == new
        self.counts["inserted_tokens"] += new
        cached.update(tuple(tokens[:n]) for n in range(len(tokens) + 1))
        self.corpus[namespace].append(tokens)

    def match(self, tokens: list[int], namespace: str) -> tuple[int, list[int]]:
        length, pages = self.cache.match(tokens, namespace)
        assert length == longest_prefix(self.reference[namespace], tokens)
        assert_matches(self.pool, pages, tokens, length)
        self.counts["hits" if length else "misses"] += 1
        self.counts["matched_tokens"] += length
        return length, pages

    @rule(spec=sequence_specs, namespace=namespaces)
    def insert_fresh(self, spec, namespace):
        """A sequence computed from scratch: its pages differ from the cached ones."""
        session = Session(BlockTable(self.pool), [], namespace)
        if self.append(session, self.sequence(spec, namespace)):
            self.insert(session.tokens, session.table.pages, namespace)
        session.table.release()

    @rule(spec=sequence_specs, namespace=namespaces)
    def match_only(self, spec, namespace):
        self.pool.decref(self.match(self.sequence(spec, namespace), namespace)[1])

    @precondition(lambda self: len(self.sessions) < MAX_SESSIONS)
    @rule(spec=sequence_specs, namespace=namespaces)
    def start_session(self, spec, namespace):
        tokens = self.sequence(spec, namespace)
        length, pages = self.match(tokens, namespace)
        session = Session(BlockTable(self.pool, pages, length), tokens[:length], namespace)
        self.sessions.append(session)
        if length < len(tokens):
            self.append(session, tokens[length:])

    @precondition(lambda self: self.sessions)
    @rule(i=indices, new=st.lists(st.integers(0, 2), min_size=1, max_size=10))
    def append_to_session(self, i, new):
        session = self.sessions[i % len(self.sessions)]
        if len(session.tokens) + len(new) <= MAX_LEN:
            self.append(session, new)

    @precondition(lambda self: self.sessions and len(self.sessions) < MAX_SESSIONS)
    @rule(i=indices)
    def fork(self, i):
        session = self.sessions[i % len(self.sessions)]
        self.sessions.append(Session(session.table.fork(), list(session.tokens), session.namespace))

    @precondition(lambda self: self.sessions)
    @rule(i=indices, cut=st.integers(0, MAX_LEN))
    def truncate(self, i, cut):
        session = self.sessions[i % len(self.sessions)]
        n = cut % (len(session.tokens) + 1)
        session.table.truncate(n)
        del session.tokens[n:]

    @precondition(lambda self: self.sessions)
    @rule(i=indices)
    def publish_session(self, i):
        session = self.sessions[i % len(self.sessions)]
        self.insert(session.tokens, session.table.pages, session.namespace)

    @precondition(lambda self: self.sessions)
    @rule(i=indices)
    def close(self, i):
        self.sessions.pop(i % len(self.sessions)).table.release()

    @rule(num_pages=st.integers(1, 6))
    def evict_pages(self, num_pages):
        self.evict(num_pages)

    @invariant()
    def pages_are_accounted_for(self):
        self.pool.check()

    @invariant()
    def sessions_kv_is_intact(self):
        for s in self.sessions:
            assert s.table.length == len(s.tokens)
            assert torch.equal(read_kv(self.pool, s.table.pages, len(s.tokens)), expected_kv(s.tokens))

    @invariant()
    def tree_equals_reference(self):
        assert cached_prefixes(self.cache) == self.reference
        check_node_pages(self.cache)

    @invariant()
    def counters_agree(self):
        stats = self.cache.stats()
        assert {name: stats[name] for name in self.counts} == self.counts
        assert stats["cached_tokens"] == sum(len(cached) - 1 for cached in self.reference.values())
        assert stats["cached_pages"] == len(set(self.cache.held_pages()))
        assert stats["num_nodes"] == sum(1 for _ in tree_nodes(self.cache))

    def teardown(self):
        for session in self.sessions:
            session.table.release()
        self.cache.clear()


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
