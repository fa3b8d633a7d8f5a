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

Nodes are ids into parallel lists of ints, and a node's children a dict of
token -> id: objects the garbage collector does not track. As one object
per node, with parent links and child dicts, a server's trees (millions of
nodes) were walked whole by every full collection, which made indexing a
turn's tokens several times dearer in a 12-agent run
(docs/bench_agents_equal_memory.md).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Hashable, Sequence

ROOT = 0  # the empty substring's node


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
        # Node i: its token, count (occurrences of its substring), parent,
        # children (token -> node, None without any), and when and in which
        # sequence its substring was last appended. Ids of removed nodes are reused.
        self._token: list[int] = [-1]
        self._count: list[int] = [0]
        self._parent: list[int] = [-1]
        self._kids: list[dict[int, int] | None] = [None]
        self._stamp: list[int] = [0]
        self._ref: list[Hashable] = [None]
        self._free: list[int] = []
        self._seqs: dict[Hashable, list[int]] = {}
        self._active: dict[Hashable, list[int]] = {}  # [d - 1]: the node of the suffix of length d
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
        token_of, count, parent, kids = self._token, self._count, self._parent, self._kids
        stamps, refs, free = self._stamp, self._ref, self._free
        longest = self.max_depth - 1
        created = 0
        for token in tokens:
            stamp = next(self._clock)
            new = []
            # The root extends to the suffix of length 1; the longest active
            # suffix stops growing at max_depth.
            for node in (ROOT, *active[:longest]):
                children = kids[node]
                child = children.get(token) if children is not None else None
                if child is None:
                    if free:
                        child = free.pop()
                        token_of[child], count[child], parent[child] = token, 1, node
                        stamps[child], refs[child] = stamp, key
                    else:
                        child = len(token_of)
                        token_of.append(token)
                        count.append(1)
                        parent.append(node)
                        kids.append(None)
                        stamps.append(stamp)
                        refs.append(key)
                    if children is None:
                        kids[node] = {token: child}
                    else:
                        children[token] = child
                    created += 1
                else:
                    count[child] += 1
                    stamps[child], refs[child] = stamp, key
                new.append(child)
            active[:] = new
        seq.extend(tokens)
        self.num_tokens += len(tokens)
        self.num_nodes += created

    def _unlink(self, node: int) -> None:
        """Remove node, a leaf, from its parent's children; its id is free."""
        p = self._parent[node]
        children = self._kids[p]
        del children[self._token[node]]
        if not children:
            self._kids[p] = None
        self._ref[node] = None
        self._free.append(node)
        self.num_nodes -= 1

    def truncate(self, key: Hashable, n: int) -> None:
        """Keep the first n tokens of the sequence under key."""
        seq = self._seqs[key]
        if not 0 <= n <= len(seq):
            raise ValueError(f"cannot truncate a sequence of {len(seq)} tokens to {n}")
        active, count, parent = self._active[key], self._count, self._parent
        while len(seq) > n:
            for node in active:
                count[node] -= 1
                if count[node] == 0:
                    # Its only occurrence ended here: nothing extends it, it is a leaf.
                    self._unlink(node)
            seq.pop()
            self.num_tokens -= 1
            # The suffix of length d + 1 ending at the removed token has as
            # parent the suffix of length d ending one token earlier.
            active[:] = [parent[node] for node in active[1:]]
            if len(seq) >= self.max_depth:
                active.append(self._find(seq[len(seq) - self.max_depth :]))

    def drop_front(self, key: Hashable, n: int) -> None:
        """Forget the first n tokens of the sequence under key: every substring
        that starts in them, so the tree then holds exactly its remaining
        tokens. O(max_depth) per token, like extend."""
        seq = self._seqs[key]
        if not 0 <= n <= len(seq):
            raise ValueError(f"cannot drop {n} tokens from a sequence of {len(seq)}")
        count, kids = self._count, self._kids
        for start in range(n):
            path = seq[start : start + self.max_depth]
            node = ROOT
            for depth, token in enumerate(path):
                node = kids[node][token]
                count[node] -= 1
                if count[node] == 0:
                    # This was its last occurrence, and so of the rest of the
                    # path below it, which nothing else reaches: leaves first.
                    chain = [node]
                    for t in path[depth + 1 :]:
                        chain.append(kids[chain[-1]][t])
                    for dead in reversed(chain):
                        self._unlink(dead)
                    break
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
        return self.num_tokens if node == ROOT else (self._count[node] if node is not None else 0)

    def continuations(self, pattern: Sequence[int]) -> dict[int, int]:
        """Token -> how often it follows pattern (within the depth bound)."""
        node = self._find(pattern)
        children = self._kids[node] if node is not None else None
        if not children:
            return {}
        return {t: self._count[c] for t, c in children.items()}

    def _find(self, pattern: Sequence[int]) -> int | None:
        node, kids = ROOT, self._kids
        for token in pattern:
            children = kids[node]
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

    def _best(self, nodes: list[int], max_tokens: int, max_factor: float, min_prob: float, discount: int,
              newest: bool) -> Draft:
        # nodes[m - 1]: the node of the pattern's last m tokens.
        best = Draft()
        for m, node in enumerate(nodes, 1):
            if self._kids[node] is None:
                continue
            draft = self._walk(node, min(max_tokens, int(m * max_factor + 1e-6)), min_prob, discount, newest)
            if draft.tokens and draft.score >= best.score:
                draft.match_len = m
                best = draft
        return best

    def _walk(self, node: int, limit: int, min_prob: float, discount: int, newest: bool) -> Draft:
        draft, prob = Draft(), 1.0
        count, stamps, kids = self._count, self._stamp, self._kids
        rank = stamps.__getitem__ if newest else (lambda c: (count[c], stamps[c]))
        while len(draft.tokens) < limit and kids[node]:
            child = max(kids[node].values(), key=rank)
            p = prob * count[child] / (count[node] - discount)
            discount = 0
            if p < min_prob:
                break
            prob, node = p, child
            draft.tokens.append(self._token[child])
            draft.probs.append(prob)
            draft.score += prob
            draft.ref = self._ref[child]
        return draft
