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
waits whole. Programs are weighed first come, first served; a later one
that fits where the first waiting one does not is admitted around it
(backfilling), but only while that one has waited less than
BACKFILL_WAIT_S: then every later program waits behind it, so none starves.
Admitted programs keep their place across their
tool pauses, so their KV is never traded against a newcomer's: what would
have thrashed queues instead; what a waiting program's turn will reuse
from the prefix cache gives way only after idle sessions past their pin
(engine.kv_policy). A program frees its place when it ends (its
sequences close) or stays idle past its pin (its KV may then give way: it
is parked).

A program's next turn is expected to grow it as much as its own later turns
did (a moving estimate); a program with none yet, as much as other
programs' later turns did: its first turn carries its whole prompt, a poor
guess of what a turn adds.

So that the pool's compute does not idle through admitted programs' tool
pauses while programs wait, a step that would have no work runs the first
waiting program's request as a guest (engine.batch_planner) when its turn
would be computed before any admitted program is expected back: it holds
no place, takes only pages nothing admitted is due back for, never preempts
an admitted program's request, and its KV gives way first. Started just
before a program returns, it would only trade its work for that program's
time; a program overdue from a long tool is expected to stay away about as
long again (engine.retention.due_in). A guest's next turn is admitted whole
once it fits, else it waits, or runs as a guest again. Stepped inline,
nothing else can come back while the caller waits, so no return is
expected (expect_returns).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from agentkv.engine.kv_policy import KVPolicy
from agentkv.engine.request import Request
from agentkv.engine.sequence import Sequence

# Weight of a new turn in the moving estimates of growth.
SMOOTHING = 0.3
# Backfilling (ProgramAdmission._may_weigh): how long the first waiting
# program may be passed over, and how many later ones a pass weighs.
BACKFILL_WAIT_S = 30.0
BACKFILL_PER_PASS = 8


@dataclass(eq=False)
class Program:
    key: str
    delta: int = 0  # tokens its latest turn queued beyond what was held or cached
    reply: int = 0  # tokens its latest turn may draw
    cached: tuple[int, ...] = ()  # prefix-cache pages its latest turn will reuse
    growth: int = 0  # tokens its next turn is expected to add


@dataclass
class Growth:
    """What a program's turns added, kept while it lives (its place may come and go)."""
    turns: int = 0
    length: int = 0  # its tokens when its latest turn was noted
    noted_at: float = -1.0  # that turn's request's queued_at: each turn is noted once
    later: float | None = None  # moving estimate over its turns after the first


class ProgramAdmission:
    def __init__(self, capacity_pages: int, page_size: int, family: Callable[[str], set[Sequence]],
                 enabled: bool = True, policy: KVPolicy | None = None):
        self.capacity = capacity_pages  # the pool's plus the second tier's host memory's, in pages
        self.page_size = page_size
        # A program's live sequences (Sequences.family): its session, and a fork
        # working a turn, which the session adopts when the turn ends.
        self.family = family
        self.enabled = enabled
        self.policy = policy
        # A loop serves others while a request waits (Scheduler.start): idle
        # KV may come back meanwhile, so work may wait for it (batch_planner).
        self.expect_returns = False
        self.admitted: dict[str, Program] = {}
        self._growth: dict[str, Growth] = {}
        self._later: float | None = None  # moving estimate of any program's later turns' growth
        self.refusals = 0  # requests a step left waiting for their program's admission
        self._head_since: float | None = None  # when the first program this pass left waiting queued
        self._weighed = 0  # programs this pass left waiting
        self._guest_taken = False  # this step weighed running a guest already

    def start_pass(self) -> None:
        """A step's planning begins: places of programs that ended or went idle past their pin are freed."""
        now = time.monotonic()
        for key in list(self.admitted):
            family = self.family(key)
            if not family or all(not s.busy and s.pin_ttl is not None and now - s.idle_since >= s.pin_ttl
                                 for s in family):
                del self.admitted[key]
        for key in [k for k in self._growth if k not in self.admitted and not self.family(k)]:
            del self._growth[key]  # the program ended
        self._head_since, self._weighed = None, 0
        self._guest_taken = False

    def admit(self, req: Request, guest: bool = False) -> bool:
        """Whether req may run: its program holds a place (taking one if it
        fits), or, with guest (the step would have no work otherwise), it is
        the first waiting program's and runs as a guest. False: req waits."""
        seq = req.seq
        p = self.admitted.get(seq.key)
        if p is not None:
            self._note_turn(p, req)
            return True
        if not self.enabled:
            return True
        # It must fit, or be alone: the pool is then all its own.
        weigh, as_guest = self._may_weigh(), guest and not self._guest_taken  # a guest: the first waiting only
        if weigh or as_guest:
            candidate = Program(seq.key)
            self._note_turn(candidate, req)
            if weigh and (self._fits(candidate) or not self.admitted):
                self.admitted[seq.key] = candidate
                return True
            if as_guest:
                self._guest_taken = True
                if self._idle_for(candidate):
                    return True
        if self._head_since is None:
            self._head_since = req.queued_at
        self._weighed += 1
        self.refusals += 1
        return False

    def _may_weigh(self) -> bool:
        """Whether the next waiting program may be weighed for a place this
        pass: the first always; a later one, backfilling around those left
        waiting (a smaller program fits where the first does not: served
        strictly in order, agents with short turns waited behind one long
        one for most of a run), only while the first has waited less than
        BACKFILL_WAIT_S (then it is served first, so it never starves) and
        at most BACKFILL_PER_PASS of them (a long queue costs a step little)."""
        if self._head_since is None:
            return True
        return time.monotonic() - self._head_since < BACKFILL_WAIT_S and self._weighed <= BACKFILL_PER_PASS

    def placed(self, key: str) -> bool:
        """Whether the program runs by right: it holds a place, or admission is off."""
        return not self.enabled or key in self.admitted

    def waits(self, req: Request) -> bool:
        """Whether req waits for its program's place (none held yet)."""
        return self.enabled and not req.admitted and req.seq.key not in self.admitted

    def _idle_for(self, candidate: Program) -> bool:
        """Whether no admitted program runs or is expected back before the
        candidate's turn would be computed."""
        policy = self.policy
        turn_s = candidate.delta * (policy.prefill_s_per_token or 0.0) if policy is not None else 0.0
        now = time.monotonic()
        for key in self.admitted:
            for s in self.family(key):
                if s.busy:
                    return False
                if self.expect_returns and policy is not None and policy.retention.due_in(s, now) < turn_s:
                    return False
        return True

    def _fits(self, candidate: Program) -> bool:
        """Whether the admitted programs' working sets and the candidate's fit:
        the pages they hold or will reuse (each once), what each one's turn
        still has to compute, what its next turn is expected to add, and the
        replies."""
        held: set[int] = set()
        tokens = 0
        for p in (*self.admitted.values(), candidate):
            family = self.family(p.key)
            for s in family:
                held.update(s.table.held_pages())
            held.update(p.cached)
            pending = p.delta if p is candidate else max((s.pending for s in family), default=0)
            tokens += pending + p.growth + p.reply
        return len(held) + -(-tokens // self.page_size) <= self.capacity

    def evict(self, key: str) -> None:
        """The program's running request was preempted: its place goes, and
        it is admitted again, whole, once it fits."""
        self.admitted.pop(key, None)

    def _note_turn(self, p: Program, req: Request) -> None:
        seq = req.seq
        # As the KV policy reuses it: a sequence holding no KV starts from the cached prefix.
        length, pages = self.policy.cached_prefix(seq) if self.policy is not None else (0, [])
        p.cached = tuple(pages)
        p.delta = len(seq.tokens) - max(seq.table.length, length)
        p.reply = req.params.max_tokens if req.params is not None else 0
        # What this turn adds to the program (its tokens past its last turn's), once per turn.
        g = self._growth.setdefault(p.key, Growth())
        if g.noted_at != req.queued_at:
            g.noted_at = req.queued_at
            if g.turns:
                added = len(seq.tokens) - g.length
                g.later = added if g.later is None else (1 - SMOOTHING) * g.later + SMOOTHING * added
                self._later = added if self._later is None else (1 - SMOOTHING) * self._later + SMOOTHING * added
            g.turns += 1
            g.length = len(seq.tokens)
        guess = g.later if g.later is not None else self._later
        p.growth = round(guess) if guess is not None else p.delta

    def counts(self, waiting: list[Request], idle: list[Sequence]) -> dict[str, int]:
        """Programs admitted; queued (a request waits, no place); parked (KV
        held or offloaded, no request, no place)."""
        queued = {r.seq.key for r in waiting} - self.admitted.keys() if self.enabled else set()
        parked = {s.key for s in idle if not s.busy and len(s)} - self.admitted.keys() - queued
        return {"admitted": len(self.admitted), "queued": len(queued), "parked": len(parked)}
