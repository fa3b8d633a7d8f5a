"""Prompt-lookup drafting: propose the tokens that followed the last time the
current suffix appeared in this session's history.

Tool calls copy ids, paths and arguments out of the context, so the most
recent earlier occurrence of the last few tokens is a cheap, often right,
guess at what comes next. For each n the drafter keeps an index from n-gram
to the stack of positions where it ended, so a lookup is O(max_n) whatever
the history's length, and rolling back a rejected draft pops exactly what
extending pushed.
"""
from __future__ import annotations

from agentkv.spec.drafter import Drafter


class NGramDrafter(Drafter):
    """Per-session draft source with its own copy of the token history.

    The engine keeps it in step with the session: `extend` with every token
    the session takes in, `truncate` whenever the session is cut back.
    `draft_len` adapts to how much of recent drafts was accepted, which the
    engine reports with `record` after each verify step.
    """

    def __init__(self, max_n: int = 4, min_n: int = 1, max_k: int = 8, probe_every: int = 16):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        super().__init__(max_k, probe_every)
        self.max_n, self.min_n = max_n, min_n
        self._tokens: list[int] = []
        # _ends[n - min_n][gram] = positions e, ascending, with tokens[e - n:e] == gram.
        self._ends: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(min_n, max_n + 1)]
        # Reads and writes of the n-gram index, so tests and profiles can see
        # that the cost per token stays flat as the history grows.
        self.index_ops = 0

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self._tokens.append(token)
            end = len(self._tokens)
            for n, ends in zip(range(self.min_n, self.max_n + 1), self._ends):
                if n > end:
                    break
                ends.setdefault(tuple(self._tokens[end - n : end]), []).append(end)
                self.index_ops += 1

    def truncate(self, n: int) -> None:
        """Roll the history back to its first n tokens."""
        if not 0 <= n <= len(self._tokens):
            raise ValueError(f"cannot truncate a history of {len(self._tokens)} tokens to {n}")
        # Ends were pushed in increasing order, so the ones past the cut are
        # on top of their stacks: pop newest first.
        for end in range(len(self._tokens), n, -1):
            for size, ends in zip(range(self.min_n, self.max_n + 1), self._ends):
                if size > end:
                    break
                gram = tuple(self._tokens[end - size : end])
                stack = ends[gram]
                stack.pop()
                if not stack:
                    del ends[gram]
                self.index_ops += 1
        del self._tokens[n:]
        self._truncated(n)

    def propose(self, k: int | None = None, shared: bool = True) -> list[int]:
        """Up to k tokens (default `draft_len`) that followed the most recent
        earlier occurrence of the longest matching suffix; [] if none.
        Drafts come from this session alone, shared or not."""
        if k is None:
            k = self.draft_len
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if k == 0:
            return []
        end = len(self._tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            stack = self._ends[n - self.min_n].get(tuple(self._tokens[end - n :]))
            self.index_ops += 1
            # The top of the stack is the suffix itself.
            if stack is not None and len(stack) >= 2:
                start = stack[-2]
                return self._tokens[start : start + k]
        return []
