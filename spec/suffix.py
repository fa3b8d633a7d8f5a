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
from collections import OrderedDict

from spec.adaptive import AdaptiveLength
from spec.suffix_tree import Draft, SuffixTree

# SuffixDecoding's tree depth (vLLM's `method: suffix` defaults to 24, a draft
# no longer than its match and no token below an estimated 0.1); on the agent
# model's tool calls drafts up to twice the match, up to 16 tokens, and no
# token below 0.2 accept more per forward (docs/bench_spec.md).
MAX_DEPTH, MAX_FACTOR, MIN_PROB, MAX_K = 24, 2.0, 0.2, 16


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
    """One OutputTree per namespace, for at most max_namespaces of them (the
    least recently used goes first)."""

    def __init__(self, max_tokens: int = 1 << 15, max_namespaces: int = 16, max_depth: int = MAX_DEPTH):
        if max_namespaces < 1:
            raise ValueError(f"max_namespaces must be >= 1, got {max_namespaces}")
        self.max_tokens, self.max_namespaces, self.max_depth = max_tokens, max_namespaces, max_depth
        self._trees: OrderedDict[str, OutputTree] = OrderedDict()

    def get(self, namespace: str) -> OutputTree:
        tree = self._trees.get(namespace)
        if tree is None:
            tree = self._trees[namespace] = OutputTree(self.max_depth, self.max_tokens)
            if len(self._trees) > self.max_namespaces:
                self._trees.popitem(last=False)
        self._trees.move_to_end(namespace)
        return tree


class SuffixDrafter(AdaptiveLength):
    """Per-session drafter with NGramDrafter's interface (extend, truncate,
    propose, draft_len, record). newest=False: SuffixDecoding's walk to the
    most frequent child (an ablation)."""

    def __init__(self, outputs: OutputTree | None = None, max_depth: int = MAX_DEPTH, max_k: int = MAX_K,
                 max_factor: float = MAX_FACTOR, min_prob: float = MIN_PROB, probe_every: int = 16,
                 newest: bool = True):
        if max_factor <= 0 or not 0 < min_prob <= 1:
            raise ValueError(f"need max_factor > 0 and 0 < min_prob <= 1, got {max_factor}, {min_prob}")
        super().__init__(max_k, probe_every)
        self.outputs, self.max_factor, self.min_prob, self.newest = outputs, max_factor, min_prob, newest
        self._tree = SuffixTree(max_depth)
        self._tree.extend(0, [])
        self._from: int | None = None  # the output the last draft came from, if any
        self.from_outputs = 0  # drafts taken from the namespace's outputs

    def __len__(self) -> int:
        return len(self._tree.sequence(0))

    @property
    def tokens(self) -> list[int]:
        return self._tree.sequence(0)

    def extend(self, tokens: list[int]) -> None:
        self._tree.extend(0, tokens)

    def truncate(self, n: int) -> None:
        """Roll the history back to its first n tokens."""
        self._tree.truncate(0, n)
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
            pattern = self._tree.sequence(0)[-self._tree.max_depth :]
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
