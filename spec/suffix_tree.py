"""A depth-bounded suffix tree (a suffix trie of depth max_depth) over several
token sequences, with occurrence counts: the data structure behind
SuffixDecoding (arXiv 2411.04975).

A node spells a substring of at most max_depth tokens; its count is how many
times that substring occurs across the sequences held. Each sequence keeps its
"active" nodes, one per suffix of its last max_depth tokens, so appending a
token costs O(max_depth) (each active node steps to a child) and so does
removing the last token (each active node gives way to its parent, whose
occurrence ends one token earlier). Nothing here is path-compressed: the
depth bound keeps a node count of at most max_depth per token held.

`speculate` follows SuffixDecoding: for each match length m, the node of the
pattern's last m tokens is found and a draft walks down from it while the
product of count ratios (the draft's estimated probability of being right
so far) stays at least min_prob, for at most min(max_tokens, m * max_factor)
tokens; the draft whose probabilities sum highest (the expected number of
tokens accepted) wins, the longer match on a tie. Where SuffixDecoding walks
to the most frequent child, this walks to the child seen most recently
(prompt lookup's choice): on the agent model's tool calls, which copy the
latest id or path rather than the commonest, that accepts more (measured in
docs/bench_spec.md); the frequencies still estimate, score and stop the draft.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Hashable, Sequence


class _Node:
    __slots__ = ("token", "count", "parent", "children", "stamp", "ref")

    def __init__(self, token: int, parent: "_Node | None"):
        self.token, self.parent = token, parent
        self.count = 0
        self.children: dict[int, _Node] | None = None
        # When and in which sequence this substring was last appended.
        self.stamp = 0
        self.ref: Hashable = None


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # estimated, of each prefix being right
    score: float = 0.0  # their sum: the expected number of accepted tokens
    match_len: int = 0
    ref: Hashable = None  # the sequence whose occurrence the draft's last token was last seen in


class SuffixTree:
    def __init__(self, max_depth: int = 24):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._root = _Node(-1, None)
        self._seqs: dict[Hashable, list[int]] = {}
        self._active: dict[Hashable, list[_Node]] = {}  # [d - 1]: the suffix of length d
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.num_tokens = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def sequence(self, key: Hashable) -> list[int]:
        """The tokens held under key (read-only use)."""
        return self._seqs[key]

    def extend(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Append tokens to the sequence under key (a new one if absent)."""
        seq = self._seqs.setdefault(key, [])
        active = self._active.setdefault(key, [])
        for token in tokens:
            stamp = next(self._clock)
            new = []
            # The root extends to the suffix of length 1; the longest active
            # suffix stops growing at max_depth.
            for node in itertools.chain((self._root,), active[: self.max_depth - 1]):
                children = node.children
                if children is None:
                    children = node.children = {}
                child = children.get(token)
                if child is None:
                    child = children[token] = _Node(token, node)
                    self.num_nodes += 1
                child.count += 1
                child.stamp, child.ref = stamp, key
                new.append(child)
            active[:] = new
            seq.append(token)
            self.num_tokens += 1

    def truncate(self, key: Hashable, n: int) -> None:
        """Keep the first n tokens of the sequence under key."""
        seq = self._seqs[key]
        if not 0 <= n <= len(seq):
            raise ValueError(f"cannot truncate a sequence of {len(seq)} tokens to {n}")
        active = self._active[key]
        while len(seq) > n:
            for node in active:
                node.count -= 1
                if node.count == 0:
                    # Its only occurrence ended here: nothing extends it, it is a leaf.
                    parent = node.parent
                    del parent.children[node.token]
                    if not parent.children:
                        parent.children = None
                    self.num_nodes -= 1
            seq.pop()
            self.num_tokens -= 1
            # The suffix of length d + 1 ending at the removed token has as
            # parent the suffix of length d ending one token earlier.
            active[:] = [node.parent for node in active[1:]]
            if len(seq) >= self.max_depth:
                active.append(self._find(seq[len(seq) - self.max_depth :]))

    def drop_front(self, key: Hashable, n: int) -> None:
        """Forget the first n tokens of the sequence under key: every substring
        that starts in them, so the tree then holds exactly its remaining
        tokens. O(max_depth) per token, like extend."""
        seq = self._seqs[key]
        if not 0 <= n <= len(seq):
            raise ValueError(f"cannot drop {n} tokens from a sequence of {len(seq)}")
        for start in range(n):
            path = seq[start : start + self.max_depth]
            node = self._root
            for depth, token in enumerate(path, 1):
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    # This was its last occurrence, and so of the rest of the
                    # path below it, which nothing else reaches.
                    del node.children[token]
                    if not node.children:
                        node.children = None
                    self.num_nodes -= len(path) - depth + 1
                    break
                node = child
        # Suffixes reaching into the dropped tokens are no longer held.
        del self._active[key][len(seq) - n :]
        del seq[:n]
        self.num_tokens -= n

    def remove(self, key: Hashable) -> None:
        """Drop the sequence under key and every count it added."""
        self.truncate(key, 0)
        del self._seqs[key], self._active[key]

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of pattern (at most max_depth tokens) across the sequences."""
        if len(pattern) > self.max_depth:
            raise ValueError(f"patterns are at most {self.max_depth} tokens, got {len(pattern)}")
        node = self._find(pattern)
        return self.num_tokens if node is self._root else (node.count if node is not None else 0)

    def continuations(self, pattern: Sequence[int]) -> dict[int, int]:
        """Token -> how often it follows pattern (within the depth bound)."""
        node = self._find(pattern)
        if node is None or node.children is None:
            return {}
        return {t: c.count for t, c in node.children.items()}

    def _find(self, pattern: Sequence[int]) -> _Node | None:
        node = self._root
        for token in pattern:
            children = node.children
            node = children.get(token) if children is not None else None
            if node is None:
                return None
        return node

    def speculate(self, pattern: Sequence[int], max_tokens: int, max_factor: float = 1.0,
                  min_prob: float = 0.1, newest: bool = True) -> Draft:
        """The best-scoring draft continuing pattern (see the module docstring);
        an empty Draft when nothing matches. newest=False walks to the most
        frequent child instead (SuffixDecoding's rule; ties to the newest)."""
        nodes = []
        for m in range(1, min(len(pattern), self.max_depth) + 1):
            node = self._find(pattern[len(pattern) - m :])
            if node is None:
                break  # a longer suffix cannot occur either
            nodes.append(node)
        return self._best(nodes, max_tokens, max_factor, min_prob, 0, newest)

    def speculate_end(self, key: Hashable, max_tokens: int, max_factor: float = 1.0,
                      min_prob: float = 0.1, newest: bool = True) -> Draft:
        """speculate with the end of the sequence under key as the pattern. Its
        own occurrence of the pattern has no continuation yet, so it is left
        out of the first step's odds."""
        return self._best(self._active[key], max_tokens, max_factor, min_prob, 1, newest)

    def _best(self, nodes: list[_Node], max_tokens: int, max_factor: float, min_prob: float, discount: int,
              newest: bool) -> Draft:
        # nodes[m - 1]: the node of the pattern's last m tokens.
        best = Draft()
        for m, node in enumerate(nodes, 1):
            if node.children is None:
                continue
            draft = self._walk(node, min(max_tokens, int(m * max_factor + 1e-6)), min_prob, discount, newest)
            if draft.tokens and draft.score >= best.score:
                draft.match_len = m
                best = draft
        return best

    @staticmethod
    def _walk(node: _Node, limit: int, min_prob: float, discount: int, newest: bool) -> Draft:
        draft, prob = Draft(), 1.0
        rank = (lambda c: c.stamp) if newest else (lambda c: (c.count, c.stamp))
        while len(draft.tokens) < limit and node.children:
            child = max(node.children.values(), key=rank)
            p = prob * child.count / (node.count - discount)
            discount = 0
            if p < min_prob:
                break
            prob, node = p, child
            draft.tokens.append(child.token)
            draft.probs.append(prob)
            draft.score += prob
            draft.ref = child.ref
        return draft
