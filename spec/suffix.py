"""Suffix-tree drafting (SuffixDecoding, arXiv 2411.04975): a tree over the
session's own tokens and one over the recent finished outputs of every
session in its KV namespace; the draft is whichever tree's best continuation
scores higher (the expected number of tokens accepted, from the counts).

Agents repeat each other: the same tools with the same argument shapes and
often the values another agent just produced. A namespace's tree is a side
channel like its KV, so it is never consulted across namespaces; it is
bounded in tokens and nodes and drops the least recently useful output
first (an output is used when a draft taken from it is accepted).
"""
from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from typing import Callable

from agentkv.spec.drafter import Drafter
from agentkv.spec.suffix_tree import Draft, SuffixTree

# SuffixDecoding's tree depth (vLLM's `method: suffix` defaults to 24, a draft
# no longer than its match and no token below an estimated 0.1); on the agent
# model's tool calls drafts up to twice the match, up to 16 tokens, and no
# token below 0.2 accept more per forward (docs/bench_spec.md).
MAX_DEPTH, MAX_FACTOR, MIN_PROB, MAX_K = 24, 2.0, 0.2, 16

# A session's tree covers its last WINDOW tokens. The tree costs about 12
# nodes per token of text and up to MAX_DEPTH for random tokens (~7 KB a
# token measured), so without a window a session's drafter grows with its
# context: 32k tokens of context would hold 50-200 MB. Tool calls copy from
# recent turns; the namespace's output tree still offers older replies.
WINDOW = 1 << 13
# All session trees of an engine together: about 300 bytes a node (measured
# with tracemalloc), so some 600 MB, 20 sessions with a full window of text.
MAX_SESSION_NODES = 1 << 21


class NodeBudget:
    """A bound on the nodes of every session tree that shares it. Past it, the
    least recently extended session forgets the older half of what its tree
    holds (drafts from its recent text are what it keeps), repeatedly."""

    def __init__(self, max_nodes: int = MAX_SESSION_NODES):
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        self.max_nodes = max_nodes
        self.total = 0
        self.shrunk = 0  # times a session's tree was cut for the budget
        self._held: OrderedDict[int, tuple[weakref.ref, int]] = OrderedDict()  # id -> (drafter, its nodes)

    def __len__(self) -> int:
        return len(self._held)

    def update(self, drafter: "SuffixDrafter") -> None:
        """drafter's tree changed: count it as most recently used, then cut
        the least recently used trees until the total fits."""
        entry = self._held.pop(id(drafter), None)
        if entry is None:
            weakref.finalize(drafter, self._release, id(drafter))
        self._set(drafter, entry[1] if entry else 0)
        while self.total > self.max_nodes:
            victim = next((d for d in (ref() for ref, nodes in self._held.values() if nodes) if d is not None), None)
            if victim is None:
                break  # every tree is empty: cannot happen while the counts are right
            victim.forget_older()
            self.shrunk += 1
            # Still the least recent: cut it again before a busier session.
            self._set(victim, self._held.pop(id(victim))[1])
            self._held.move_to_end(id(victim), last=False)

    def _set(self, drafter: "SuffixDrafter", old_nodes: int) -> None:
        nodes = drafter.tree.num_nodes
        self._held[id(drafter)] = (weakref.ref(drafter), nodes)
        self.total += nodes - old_nodes

    def _release(self, key: int) -> None:
        entry = self._held.pop(key, None)
        if entry is not None:
            self.total -= entry[1]


class OutputTree:
    """Finished outputs of one namespace's sessions, newest and most useful
    kept: at most max_tokens tokens, max_nodes tree nodes (up to max_depth
    per token, a few hundred bytes each) and max_outputs outputs."""

    def __init__(self, max_depth: int = MAX_DEPTH, max_tokens: int = 1 << 15, max_nodes: int = 1 << 17,
                 max_outputs: int = 4096):
        if min(max_tokens, max_nodes, max_outputs) < 1:
            raise ValueError(f"need max_tokens, max_nodes and max_outputs >= 1, got {max_tokens}, {max_nodes}, {max_outputs}")
        self.max_tokens, self.max_nodes, self.max_outputs = max_tokens, max_nodes, max_outputs
        self.tree = SuffixTree(max_depth)
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._keys = itertools.count()
        self.evicted = 0

    def __len__(self) -> int:
        """Outputs held."""
        return len(self._lru)

    def add(self, tokens: list[int]) -> None:
        if not tokens:
            return
        key = next(self._keys)
        self.tree.extend(key, tokens[-self.max_tokens :])
        self._lru[key] = None
        while len(self._lru) > 1 and (self.tree.num_tokens > self.max_tokens or self.tree.num_nodes > self.max_nodes
                                      or len(self._lru) > self.max_outputs):
            old, _ = self._lru.popitem(last=False)
            self.tree.remove(old)
            self.evicted += 1

    def touch(self, key: int) -> None:
        """A draft from this output was accepted: evict it last."""
        if key in self._lru:
            self._lru.move_to_end(key)

    def speculate(self, pattern: list[int], max_tokens: int, max_factor: float, min_prob: float,
                  newest: bool = True) -> Draft:
        return self.tree.speculate(pattern, max_tokens, max_factor, min_prob, newest)


class OutputTrees:
    """One OutputTree per namespace, for at most max_namespaces of each
    owner's (owner(namespace): a tenant, whose cache salts are namespaces of
    its own; by default one owner for all); past that the owner's least
    recently used goes, never another owner's, so no tenant cycling salts
    erases another's history."""

    def __init__(self, max_tokens: int = 1 << 15, max_namespaces: int = 16, max_depth: int = MAX_DEPTH,
                 owner: Callable[[str], str] = lambda namespace: ""):
        if max_namespaces < 1:
            raise ValueError(f"max_namespaces must be >= 1, got {max_namespaces}")
        self.max_tokens, self.max_namespaces, self.max_depth = max_tokens, max_namespaces, max_depth
        self.owner = owner
        self._trees: dict[str, OrderedDict[str, OutputTree]] = {}  # owner -> its namespaces' trees, LRU first

    def get(self, namespace: str) -> OutputTree:
        trees = self._trees.setdefault(self.owner(namespace), OrderedDict())
        tree = trees.get(namespace)
        if tree is None:
            tree = trees[namespace] = OutputTree(self.max_depth, self.max_tokens)
            if len(trees) > self.max_namespaces:
                trees.popitem(last=False)
        trees.move_to_end(namespace)
        return tree


class SuffixDrafter(Drafter):
    """Per-session drafter with NGramDrafter's interface (extend, truncate,
    propose, draft_len, record), its tree over the history's last `window`
    tokens. newest=False: SuffixDecoding's walk to the most frequent child
    (an ablation)."""

    def __init__(self, outputs: OutputTree | None = None, max_depth: int = MAX_DEPTH, max_k: int = MAX_K,
                 max_factor: float = MAX_FACTOR, min_prob: float = MIN_PROB, probe_every: int = 16,
                 newest: bool = True, window: int = WINDOW, budget: NodeBudget | None = None):
        if max_factor <= 0 or not 0 < min_prob <= 1:
            raise ValueError(f"need max_factor > 0 and 0 < min_prob <= 1, got {max_factor}, {min_prob}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        super().__init__(max_k, probe_every)
        self.outputs, self.max_factor, self.min_prob, self.newest = outputs, max_factor, min_prob, newest
        self.window, self.budget = window, budget
        self._history: list[int] = []
        self._start = 0  # history position of the tree's first token
        self._tree = SuffixTree(max_depth)
        self._tree.extend(0, [])
        self._from: int | None = None  # the output the last draft came from, if any
        self.from_outputs = 0  # drafts taken from the namespace's outputs

    def __len__(self) -> int:
        return len(self._history)

    @property
    def tokens(self) -> list[int]:
        """The whole history (read-only use); the tree holds its last `window` tokens."""
        return self._history

    @property
    def tree(self) -> SuffixTree:
        """The tree over the window (read-only use), sequence 0."""
        return self._tree

    def extend(self, tokens: list[int]) -> None:
        self._history.extend(tokens)
        self._tree.extend(0, tokens)
        excess = len(self._history) - self._start - self.window
        if excess > 0:
            self._drop(excess)
        if self.budget is not None:
            self.budget.update(self)

    def forget_older(self) -> None:
        """Drop the older half of what the tree holds (for a NodeBudget)."""
        self._drop((len(self._history) - self._start + 1) // 2)

    def _drop(self, n: int) -> None:
        self._tree.drop_front(0, n)
        self._start += n

    def truncate(self, n: int) -> None:
        """Roll the history back to its first n tokens."""
        if not 0 <= n <= len(self._history):
            raise ValueError(f"cannot truncate a history of {len(self._history)} tokens to {n}")
        del self._history[n:]
        if n >= self._start:
            self._tree.truncate(0, n - self._start)
        else:  # cut below the window: index the window ending at n again
            self._tree.remove(0)
            self._start = max(0, n - self.window)
            self._tree.extend(0, self._history[self._start :])
        if self.budget is not None:
            self.budget.update(self)
        self._truncated(n)

    def propose(self, k: int | None = None, shared: bool = True) -> list[int]:
        """Up to k tokens (default `draft_len`): the best-scoring continuation
        of the history's end in the session's tree or (if shared) the
        namespace's outputs; [] if neither has one."""
        if k is None:
            k = self.draft_len
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self._from = None
        if k == 0:
            return []
        best = self._tree.speculate_end(0, k, self.max_factor, self.min_prob, self.newest)
        if shared and self.outputs is not None:
            pattern = self._history[-self._tree.max_depth :]
            other = self.outputs.speculate(pattern, k, self.max_factor, self.min_prob, self.newest)
            if other.score > best.score:
                best, self._from = other, other.ref
                self.from_outputs += 1
        return best.tokens

    def record(self, drafted: int, accepted: int) -> None:
        super().record(drafted, accepted)
        if accepted and self._from is not None:
            self.outputs.touch(self._from)
        self._from = None
