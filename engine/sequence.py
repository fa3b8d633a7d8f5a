"""A sequence: the tokens of one conversation and the pages holding their KV.

The scheduler owns every sequence; a Session is a handle on one. A
sequence's KV lives across turns. The last token a generation draws is held
but not yet computed (its KV is only needed by the next append), so it rides
along with the next delta instead of costing a forward of its own.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from agentkv.cache.block_table import BlockTable
from agentkv.engine.stats import TurnStats
from agentkv.spec.drafter import Drafter



def owner_of(namespace: str) -> str:
    """Who a KV namespace belongs to: the part before its first ":" (a
    tenant's namespaces are its name and name:cache_salt, engine.api.tenants)."""
    return namespace.split(":", 1)[0]

@dataclass(eq=False)
class Sequence:
    table: BlockTable
    namespace: str
    # Program-level FCFS (Continuum): a conversation's next turn queues by
    # when the conversation began, so agents that started first finish
    # first. Forks inherit it.
    arrival: int
    # Seconds an idle sequence keeps its pages pinned; after that, under
    # memory pressure, they may be parked (published to the prefix cache and
    # released). None pins for the sequence's whole life.
    pin_ttl: float | None
    tokens: list[int] = field(default_factory=list)
    last_logits: torch.Tensor | None = None  # after the last token; valid while every token's KV is held
    drafter: Drafter | None = None  # made on first use: spec.drafters
    idle_since: float = field(default_factory=time.monotonic)
    closed: bool = False
    busy: bool = False  # a request is queued or running on it
    finish_reason: str | None = None  # of the last generation: "stop" or "length"
    turn: TurnStats = field(default_factory=TurnStats)
    # The tools its last turn called and is waiting for (engine.retention);
    # None: a final answer, or no turn yet.
    awaiting: tuple[str, ...] | None = None
    answered: bool = False  # its last turn ended with a final answer: its next one ends that pause
    # Names its KV in the second tier (cache.kv_tier); the forks that work
    # a session's turns share it with the session.
    key: str = field(default_factory=lambda: secrets.token_hex(8))
    # A record outside the engine names it (a named session, a stored
    # response): past the idle timeout its KV leaves the pool, but it stays
    # open for the record's next turn.
    kept: bool = False
    # It counts against the session limit (Limits.max_sessions): not a turn's
    # working sequence nor a stored response's, which the queue and the
    # response store bound.
    counted: bool = True
    # Its pending tokens are what its next turn is known to begin with: the
    # scheduler computes them when it has nothing else to do (pre-positioning).
    preposition_pending: bool = False

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def pending(self) -> int:
        """Held tokens whose KV is not computed yet."""
        return len(self.tokens) - self.table.length

    def draft_index(self, make: Callable[[str], Drafter]) -> Drafter:
        """The drafter over these tokens (made by make(namespace) the first
        time), brought up to date."""
        if self.drafter is None:
            self.drafter = make(self.namespace)
        self.drafter.extend(self.tokens[len(self.drafter) :])
        return self.drafter

    def rollback(self, n: int) -> None:
        """Keep the first n tokens and only their KV."""
        del self.tokens[n:]
        self.table.truncate(min(n, self.table.length))
        self.last_logits = None
        if self.drafter is not None and len(self.drafter) > n:
            self.drafter.truncate(n)

    def expired(self, now: float) -> bool:
        """Idle past its pin time-to-live, with pages that could be released."""
        return (
            self.pin_ttl is not None
            and not self.closed
            and not self.busy
            and now - self.idle_since >= self.pin_ttl
            and bool(self.table.pages)
        )
