"""A request: work the scheduler does on one sequence.

Two kinds share one path. An append computes the sequence's pending tokens
and returns their logits (the last one's, or with all_logits every appended
token's). A generation computes what is pending, then draws tokens until a
stop. Either runs in the scheduler's steps, batched with every other request;
its outcome (tokens, logits, error) is read once `done` is set.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from agentkv.engine.grammar import GrammarState
from agentkv.engine.sequence import Sequence
from agentkv.engine.stats import TurnStats
from agentkv.model.sampler import SamplingParams

OnTokens = Callable[[list[int]], None]
OnDone = Callable[["Request"], None]


@dataclass(eq=False)
class Request:
    seq: Sequence
    params: SamplingParams | None  # None: an append, which draws nothing
    speculative: bool = True
    on_tokens: OnTokens | None = None  # streaming: called with each step's new tokens
    on_done: OnDone | None = None  # called once, from the thread that finished the request
    grammar: GrammarState | None = None  # constrains every token drawn and every draft accepted
    # Of an append: how many of its trailing tokens need logits.
    num_logits: int = 1
    arrival: int = 0  # FCFS among one sequence's requests (set by the scheduler)
    queued_at: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # an append's, chunk by chunk
    finish_reason: str | None = None  # "stop" or "length"
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    start_len: int = 0  # the sequence's length at submission: a failure rolls back to it
    start_held: int = 0  # and how many of its tokens had KV then
    generator: torch.Generator | None = None
    stop_ids: frozenset[int] = frozenset()
    ready_logits: torch.Tensor | None = None  # next-token logits the sequence already had
    turn: TurnStats | None = None  # a generation's turn record, once it finished
    admitted: bool = False  # counted as running (has been scheduled since it last queued)
    preemptions: int = 0
    progress_at_preemption: int = -1  # its progress() when last preempted: not again before it grows
    started: bool = False  # admitted at least once (what it found held or cached is counted then)
    forced: int = 0  # of its latest draft, the leading tokens the grammar forced
    _cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def is_append(self) -> bool:
        return self.params is None

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Ask the scheduler to drop this request: within one step it is
        rolled back (the sequence as before it) and fails with
        RequestCancelledError. Thread-safe; a finished request ignores it."""
        self._cancelled.set()

    def progress(self) -> int:
        """What it has produced: tokens drawn, or an append's logits."""
        return len(self.output) + len(self.logits)

    def priority(self) -> tuple[int, int]:
        """Lower runs first: the sequence's conversation's arrival, then this request's."""
        return self.seq.arrival, self.arrival
