"""The radix prefix cache: a tree over token ids whose nodes hold KV pages.

A sequence is published once its KV is computed; a later sequence with the
same prefix starts from the longest match instead of recomputing it. Matching
is token-granular, so a match may end inside a page: the caller copies that
page before writing into it (BlockTable never writes a shared page), which is
what keeps every page the tree holds immutable.

A node covers token positions [start, end) of its path and holds one reference
to each page index start // ps .. (end - 1) // ps. When start is not
page-aligned, that first index is also the parent's last one, and the child
keeps its own page for it: the same KV as the parent's before start (same
prefix), plus the child's tokens from start on. So for every page index, the
deepest node on a path that covers it has the page valid for that path.

Each namespace (tenant) has its own root, so a match never crosses them.
Eviction drops least-recently-used leaves that no session pins.
"""
from __future__ import annotations

import heapq
import itertools
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from agentkv.cache.pool import PagePool

COUNTERS = (
    "hits", "misses", "matched_tokens", "inserted_tokens", "evicted_pages", "cached_tokens", "cached_pages", "num_nodes",
)


@dataclass(eq=False, slots=True)
class _Node:
    start: int
    key: list[int]  # the tokens at positions [start, end)
    pages: list[int]  # the pages of indices start // ps .. (end - 1) // ps
    parent: "_Node | None"
    children: dict[int, "_Node"] = field(default_factory=dict)  # by first token
    last_access: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.key)


def _common_prefix(key: list[int], tokens: list[int], pos: int) -> int:
    n = min(len(key), len(tokens) - pos)
    # One C-speed comparison for the usual case of a whole edge matching.
    if key[:n] == tokens[pos : pos + n]:
        return n
    return next(i for i in range(n) if key[i] != tokens[pos + i])


def _release_all(pool: PagePool, refs: Counter[int]) -> None:
    pool.decref(list(refs.elements()))


class RadixCache:
    def __init__(self, pool: PagePool):
        self.pool = pool
        self._roots: dict[str, _Node] = {}
        self._refs: Counter[int] = Counter()  # page -> references the tree holds to it
        # (last_access, tiebreak, leaf); entries go stale when a leaf is
        # touched, grows a child or is removed, and are skipped when popped.
        self._heap: list[tuple[int, int, _Node]] = []
        self._tiebreak = itertools.count()
        self._clock = 0
        self.hits = self.misses = self.matched_tokens = self.inserted_tokens = self.evicted_pages = 0
        self.cached_tokens = self.num_nodes = 0
        pool.register(self)
        # A dropped, uncleared tree gives its pages back when collected.
        weakref.finalize(self, _release_all, pool, self._refs)

    @property
    def cached_pages(self) -> int:
        return len(self._refs)

    def stats(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTERS}

    def held_pages(self) -> Iterator[int]:
        return self._refs.elements()

    def match(self, tokens: Sequence[int], namespace: str = "default") -> tuple[int, list[int]]:
        """Longest cached prefix of tokens within namespace: (length, pages covering
        [0, length)), the last page possibly only partly valid. The pages are
        incref'd for the caller, who owns those references."""
        tokens = list(tokens)
        root = self._roots.get(namespace)
        path, length = self._descend(root, tokens) if root else ([], 0)
        pages = self._pages_along(path, length)
        self.pool.incref(pages)
        if length:
            self.hits += 1
            self.matched_tokens += length
            self._touch(path)
        else:
            self.misses += 1
        return length, pages

    def peek(self, tokens: Sequence[int], namespace: str = "default") -> tuple[int, list[int]]:
        """What match would give now, taking no references and counting no
        hit: for estimates (program admission) that must not change the cache."""
        root = self._roots.get(namespace)
        path, length = self._descend(root, list(tokens)) if root else ([], 0)
        return length, self._pages_along(path, length)

    def insert(self, tokens: Sequence[int], pages: Sequence[int], namespace: str = "default") -> int:
        """Publish tokens whose KV is in pages (tokens[i] in pages[i // ps]). The
        tree increfs the pages it newly stores; the part already cached keeps its
        own pages. Returns the number of tokens newly cached."""
        tokens = list(tokens)
        ps = self.pool.page_size
        if len(pages) != -(-len(tokens) // ps):
            raise ValueError(f"{len(tokens)} tokens need {-(-len(tokens) // ps)} pages of {ps}, got {len(pages)}")
        root = self._roots.setdefault(namespace, _Node(0, [], [], None))
        path, m = self._descend(root, tokens)
        if m == len(tokens):
            self._touch(path)
            return 0
        parent = path[-1] if path else root
        if m < parent.end:
            parent = path[-1] = self._split(parent, m)
        # From the page index of m on, the sequence's own pages: the one m falls
        # in holds the same KV as the parent's before m, and this sequence's after.
        leaf = _Node(m, tokens[m:], list(pages[m // ps :]), parent)
        parent.children[tokens[m]] = leaf
        self._hold(leaf.pages)
        self.num_nodes += 1
        self.cached_tokens += len(leaf.key)
        self.inserted_tokens += len(leaf.key)
        self._touch(path + [leaf])
        return len(leaf.key)

    def evict(self, num_pages: int, keep: frozenset[int] = frozenset()) -> int:
        """Drop least-recently-used unpinned leaves until at least num_pages pages
        are freed or none is left. A leaf is pinned while any of its pages is
        referenced outside the tree (a live session) or is in keep (what a
        caller wants kept for now: a waiting request's prefix); the pages past
        the last such one still go (a session that diverged from what it
        published holds only the head). Leaves go whole, so this may free a
        few pages more than asked. Returns the pages freed."""
        freed = 0
        pinned: set[_Node] = set()
        while freed < num_pages and (leaf := self._pop_lru_leaf()) is not None:
            if not self._pinned(leaf, keep):
                freed += self._remove(leaf)
            elif (tail := self._unpinned_tail(leaf, keep)) is not None:
                freed += self._remove(tail)  # the pinned head, now a leaf, is queued again
            else:
                pinned.add(leaf)
        for leaf in pinned:
            self._push(leaf)
        self.evicted_pages += freed
        return freed

    def clear(self) -> None:
        self.pool.decref(list(self._refs.elements()))
        self._refs.clear()
        self._roots.clear()
        self._heap.clear()
        self.cached_tokens = self.num_nodes = 0

    def _descend(self, root: _Node, tokens: list[int]) -> tuple[list[_Node], int]:
        """The nodes the longest match runs through (the last maybe partly) and its length."""
        path, node, pos = [], root, 0
        while pos < len(tokens) and (child := node.children.get(tokens[pos])) is not None:
            k = _common_prefix(child.key, tokens, pos)
            path.append(child)
            pos += k
            if k < len(child.key):
                break
            node = child
        return path, pos

    def _pages_along(self, path: list[_Node], length: int) -> list[int]:
        ps = self.pool.page_size
        pages: list[int] = []
        for node in path:
            first, last = node.start // ps, (min(node.end, length) - 1) // ps
            del pages[first:]  # a child's page for an index shared with its parent wins
            pages.extend(node.pages[: last - first + 1])
        return pages

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut node at position at (inside it); returns the new upper half. The
        page index at falls in, unless at is page-aligned, goes to both halves."""
        ps = self.pool.page_size
        cut, first = at - node.start, node.start // ps
        upper = _Node(node.start, node.key[:cut], node.pages[: (at - 1) // ps - first + 1], node.parent)
        upper.last_access = node.last_access
        node.parent.children[node.key[0]] = upper
        upper.children[node.key[cut]] = node
        node.start, node.key, node.pages, node.parent = at, node.key[cut:], node.pages[at // ps - first :], upper
        if at % ps:
            self._hold(node.pages[:1])
        self.num_nodes += 1
        return upper

    def _remove(self, leaf: _Node) -> int:
        parent = leaf.parent
        del parent.children[leaf.key[0]]
        leaf.parent = None
        self.num_nodes -= 1
        self.cached_tokens -= len(leaf.key)
        if not parent.children and parent.parent is not None:
            self._push(parent)
        return self._release(leaf.pages)

    def _unpinned_tail(self, leaf: _Node, keep: frozenset[int]) -> "_Node | None":
        """Split off the part of a pinned leaf after its last page referenced
        outside the tree or kept (cut on a page boundary); None if there is none."""
        ps = self.pool.page_size
        last = max(i for i, p in enumerate(leaf.pages) if self.pool.refcount[p] > self._refs[p] or p in keep)
        at = (leaf.start // ps + last + 1) * ps
        if at >= leaf.end:
            return None
        self._split(leaf, at)  # leaf keeps [at, end)
        return leaf

    def _pinned(self, node: _Node, keep: frozenset[int]) -> bool:
        # More references than the tree's own: someone outside holds the page.
        return any(self.pool.refcount[p] > self._refs[p] or p in keep for p in node.pages)

    def _hold(self, pages: list[int]) -> None:
        self.pool.incref(pages)
        self._refs.update(pages)

    def _release(self, pages: list[int]) -> int:
        """Drop the tree's references to pages; returns how many became free."""
        freed = 0
        for p in pages:
            self._refs[p] -= 1
            if not self._refs[p]:
                del self._refs[p]
            self.pool.decref([p])
            freed += self.pool.refcount[p] == 0
        return freed

    def _touch(self, path: list[_Node]) -> None:
        self._clock += 1
        for node in path:
            node.last_access = self._clock
        if path and not path[-1].children:
            self._push(path[-1])

    def _push(self, leaf: _Node) -> None:
        heapq.heappush(self._heap, (leaf.last_access, next(self._tiebreak), leaf))
        # Every touch leaves a stale entry behind: rebuild once they dominate.
        if len(self._heap) > 2 * self.num_nodes + 64:
            self._heap = [(n.last_access, next(self._tiebreak), n) for n in self._nodes() if not n.children]
            heapq.heapify(self._heap)

    def _pop_lru_leaf(self) -> _Node | None:
        while self._heap:
            last_access, _, node = heapq.heappop(self._heap)
            if node.parent is not None and not node.children and node.last_access == last_access:
                return node
        return None

    def _nodes(self) -> Iterator[_Node]:
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node
