"""Program-aware admission: an agent's turns are one program, and programs
are admitted whole, only while their KV fits (ThunderAgent's program
scheduling; Continuum's program-level first come, first served).

A program is a session and the forks that work its turns (they share the
sequence key that names its KV in the second tier); a request without a
session is a program of one turn. Its working set is the KV it holds plus
what it is expected to add: the tokens its latest turn queued beyond what
was held or is in the prefix cache (its delta), the same again for its
next turn (turns of one agent grow alike), and the reply it may still
draw. Pages are counted once however many programs hold them (agents of
one role share their system prompt and tools, copy-on-write, and a
newcomer reuses what the prefix cache holds): counting each program's
prefix apart admitted a few agents where the pool held them all.

A new program's first request is admitted only while the admitted programs'
working sets and its own fit the pool plus the second tier; otherwise it
waits whole, and so does every program that came after it (first come,
first served by program). Admitted programs keep their place across their
tool pauses, so their KV is never traded against a newcomer's: what would
have thrashed queues instead; what a waiting program's turn will reuse
from the prefix cache gives way only after idle sessions past their pin
(engine.kv_policy). A program frees its place when it ends (its
sequences close) or stays idle past its pin (its KV may then give way: it
is parked). So that nothing waits on work that is not running, a program is
also admitted whenever no admitted program has a request in flight.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from agentkv.engine.request import Request
from agentkv.engine.sequence import Sequence

# The prefix cache's (length, pages) for a sequence holding no KV, (0, []) for one that holds some.
Cached = Callable[[Sequence], tuple[int, list[int]]]


@dataclass(eq=False)
class Program:
    key: str
    delta: int = 0  # tokens its latest turn queued beyond what was held or cached
    reply: int = 0  # tokens its latest turn may draw
    cached: tuple[int, ...] = ()  # prefix-cache pages its latest turn will reuse


class ProgramAdmission:
    def __init__(self, capacity_pages: int, page_size: int, family: Callable[[str], set[Sequence]],
                 enabled: bool = True, cached: Cached | None = None):
        self.capacity = capacity_pages  # the pool's plus the second tier's host memory's, in pages
        self.page_size = page_size
        # A program's live sequences (Sequences.family): its session, and a fork
        # working a turn, which the session adopts when the turn ends.
        self.family = family
        self.enabled = enabled
        self.cached = cached
        self.admitted: dict[str, Program] = {}
        self.refusals = 0  # requests a step left waiting for their program's admission
        self._queue_closed = False  # this pass refused a program: later ones wait too

    def start_pass(self) -> None:
        """A step's planning begins: places of programs that ended or went idle past their pin are freed."""
        now = time.monotonic()
        for key in list(self.admitted):
            family = self.family(key)
            if not family or all(not s.busy and s.pin_ttl is not None and now - s.idle_since >= s.pin_ttl
                                 for s in family):
                del self.admitted[key]
        self._queue_closed = False

    def admit(self, req: Request) -> bool:
        """Whether req's program holds a place (taking one if it fits); False: req waits."""
        seq = req.seq
        p = self.admitted.get(seq.key)
        if p is not None:
            self._note_turn(p, req)
            return True
        if not self.enabled:
            return True
        # Once one program waits this step, the rest do (checked first: a
        # long queue costs the step nothing more); else it must fit while
        # any admitted program is running.
        if not self._queue_closed:
            candidate = Program(seq.key)
            self._note_turn(candidate, req)
            if not self._running() or self._fits(candidate):
                self.admitted[seq.key] = candidate
                return True
        # First come, first served: a program that came later never passes one left waiting.
        self._queue_closed = True
        self.refusals += 1
        return False

    def waits(self, req: Request) -> bool:
        """Whether req waits for its program's place (none held yet)."""
        return self.enabled and not req.admitted and req.seq.key not in self.admitted

    def _running(self) -> bool:
        return any(s.busy for key in self.admitted for s in self.family(key))

    def _fits(self, candidate: Program) -> bool:
        """Whether the admitted programs' working sets and the candidate's fit:
        the pages they hold or will reuse (each once), what each one's turn
        still has to compute and as much again for its next, and the replies."""
        held: set[int] = set()
        tokens = 0
        for p in (*self.admitted.values(), candidate):
            family = self.family(p.key)
            for s in family:
                held.update(s.table.held_pages())
            held.update(p.cached)
            pending = p.delta if p is candidate else max((s.pending for s in family), default=0)
            tokens += pending + p.delta + p.reply
        return len(held) + -(-tokens // self.page_size) <= self.capacity

    def evict(self, key: str) -> None:
        """The program's running request was preempted: its place goes, and
        it is admitted again, whole, once it fits."""
        self.admitted.pop(key, None)

    def _note_turn(self, p: Program, req: Request) -> None:
        seq = req.seq
        # As the KV policy reuses it: a sequence holding no KV starts from the cached prefix.
        length, pages = self.cached(seq) if self.cached is not None else (0, [])
        p.cached = tuple(pages)
        p.delta = len(seq.tokens) - max(seq.table.length, length)
        p.reply = req.params.max_tokens if req.params is not None else 0

    def counts(self, waiting: list[Request], idle: list[Sequence]) -> dict[str, int]:
        """Programs admitted; queued (a request waits, no place); parked (KV
        held or offloaded, no request, no place)."""
        queued = {r.seq.key for r in waiting} - self.admitted.keys() if self.enabled else set()
        parked = {s.key for s in idle if not s.busy and len(s)} - self.admitted.keys() - queued
        return {"admitted": len(self.admitted), "queued": len(queued), "parked": len(parked)}
