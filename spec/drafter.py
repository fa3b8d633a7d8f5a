"""The base of every drafter (spec.ngram, spec.suffix): how long a draft to
propose next, learned from how much of the recent ones the target model
accepted."""
from __future__ import annotations


class Drafter:
    """A drafter's draft length and acceptance counts. Subclasses hold the
    token history (len(self)), propose drafts from it, and call `_truncated`
    when it is cut back."""

    def __init__(self, max_k: int = 8, probe_every: int = 16):
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.max_k, self.probe_every = max_k, probe_every
        # Start optimistic: agent traffic copies a lot, and a few misses
        # bring the length down quickly.
        self._len = max_k
        self._last_draft_at = 0
        self.drafted = 0
        self.accepted = 0
        self.verify_steps = 0

    def __len__(self) -> int:
        raise NotImplementedError

    def _truncated(self, n: int) -> None:
        self._last_draft_at = min(self._last_draft_at, n)

    @property
    def draft_len(self) -> int:
        """How many tokens to draft next. At 0, every probe_every tokens a
        one-token probe checks whether the text has started copying again."""
        if self._len > 0:
            return self._len
        return 1 if len(self) - self._last_draft_at >= self.probe_every else 0

    def record(self, drafted: int, accepted: int) -> None:
        """Report one verify step: `drafted` tokens proposed, the first
        `accepted` of them confirmed by the target model."""
        if not 0 <= accepted <= drafted or drafted < 1:
            raise ValueError(f"need 0 <= accepted <= drafted and drafted >= 1, got {accepted}/{drafted}")
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1
        self._last_draft_at = len(self)
        if accepted == drafted:
            # A copied span tends to go on: ramp fast. A draft cut short by the
            # end of its match says nothing against the current length.
            self._len = min(self.max_k, max(self._len, 2 * drafted))
        elif accepted > 0:
            self._len = min(self.max_k, accepted + 1)
        else:
            self._len = min(self._len, drafted) // 2

    @property
    def mean_accepted(self) -> float:
        """Draft tokens accepted per verify step (the bonus token not counted)."""
        return self.accepted / self.verify_steps if self.verify_steps else 0.0
