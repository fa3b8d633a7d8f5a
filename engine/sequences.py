"""Every sequence of one engine, and the operations on an idle one.

One lock guards the sequences, the pool and the model: each operation here
takes it, and so does each scheduler step, so an operation never sees a
step half done. It is granted in the order asked for (engine.fair_lock): an
operation waits for the step under way, not for every step while the loop
keeps taking it back. A busy or closed sequence is refused before the lock
is waited for, so that a session with a request in flight is answered at
once. A session dropped unclosed is closed by its collector only if the lock
is free, else by the next holder that looks (the scheduler, every step): the
collector may be the server's event loop, which must not wait for a step.
"""
from __future__ import annotations

import itertools
import time
import weakref
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from agentkv.cache.block_table import BlockTable
from agentkv.cache.pool import PagePool
from agentkv.engine.errors import SessionBusyError, SessionClosedError, TooManySessionsError
from agentkv.engine.fair_lock import FairLock
from agentkv.engine.kv_policy import KVPolicy
from agentkv.engine.sequence import Sequence


class Sequences:
    def __init__(self, pool: PagePool, policy: KVPolicy, max_sessions: int):
        self.pool, self.policy, self.max_sessions = pool, policy, max_sessions
        self.lock = FairLock()
        self.all: set[Sequence] = set()
        # Live sequences by key: a session and the forks that work its turns.
        self._families: dict[str, set[Sequence]] = {}
        # Called (under the lock) before a sequence is closed: the scheduler
        # fails whatever request it still has.
        self.on_close: Callable[[Sequence], None] = lambda seq: None
        self._arrivals = itertools.count()
        self._dropped: deque[Sequence] = deque()  # collected while the lock was held: closed by close_dropped

    def new(
        self, namespace: str, pin_ttl: float | None, tokens: Iterable[int] = (), table: BlockTable | None = None,
        arrival: int | None = None, key: str | None = None, counted: bool = True,
    ) -> Sequence:
        """A new sequence. One that counts (see Sequence.counted) past the
        session limit is refused, TooManySessionsError, and nothing changes (a
        table handed in is released): the limit never closes a session that
        someone holds to make room."""
        with self.lock:
            self.close_dropped()
            if counted and sum(s.counted for s in self.all) >= self.max_sessions:
                if table is not None:
                    table.release()
                raise TooManySessionsError(self.max_sessions)
            seq = Sequence(table if table is not None else BlockTable(self.pool), namespace,
                           next(self._arrivals) if arrival is None else arrival, pin_ttl, list(tokens),
                           counted=counted)
            if key is not None:
                seq.key = key
            self.all.add(seq)
            self._families.setdefault(seq.key, set()).add(seq)
            return seq

    def family(self, key: str) -> set[Sequence]:
        """The live sequences under key (a copy); empty once all are closed."""
        return set(self._families.get(key, ()))

    @contextmanager
    def idle(self, seq: Sequence) -> Iterator[None]:
        """The lock, for work on seq, which must be open and without a request."""
        self.check_idle(seq)
        with self.lock:
            self.check_idle(seq)
            yield

    def check_idle(self, seq: Sequence) -> None:
        if seq.closed:
            raise SessionClosedError("the session is closed")
        if seq.busy:
            raise SessionBusyError("the session already has a request in flight")

    def fork(self, seq: Sequence, for_turn: bool = False, counted: bool = True) -> Sequence:
        """A sequence sharing every page of seq (copy-on-write) and its
        conversation's priority. for_turn: it works seq's next turn, so it
        shares seq's KV in the second tier, and seq's pause ends now (never
        counted). counted: see Sequence.counted."""
        with self.idle(seq):
            if for_turn:
                self.policy.retention.resumed(seq, time.monotonic())
            return self.new(seq.namespace, seq.pin_ttl, seq.tokens, seq.table.fork(), seq.arrival,
                            seq.key if for_turn else None, counted=counted and not for_turn)

    def truncate(self, seq: Sequence, n: int) -> None:
        with self.idle(seq):
            if n < len(seq.tokens):
                seq.rollback(n)

    def extend(self, seq: Sequence, tokens: list[int], preposition: bool = False) -> None:
        """Hold tokens without computing them: the next request computes them
        (with preposition, the scheduler may compute them first, when idle)."""
        with self.idle(seq):
            seq.tokens.extend(tokens)
            seq.last_logits = None
            seq.preposition_pending = preposition

    def adopt(self, into: Sequence, source: Sequence) -> None:
        """into takes over source's tokens, pages and turn (source is closed); into's own pages go."""
        with self.idle(into), self.idle(source):
            into.table.release()
            into.table, source.table = source.table, BlockTable(self.pool)
            into.tokens, source.tokens = source.tokens, []
            into.drafter, source.drafter = source.drafter, None
            into.last_logits, into.finish_reason, into.turn = source.last_logits, source.finish_reason, source.turn
            into.idle_since = source.idle_since
            self.close(source)

    def end_turn(self, seq: Sequence, tools: list[str], expected_s: float | None = None) -> None:
        """The turn ended on these tool calls (none: a final answer): the retention policy pins it."""
        with self.idle(seq):
            self.policy.retention.end_turn(seq, tools, expected_s)

    def retain(self, seq: Sequence, seconds: float | None) -> None:
        """Pin seq's pages for `seconds` from now (None: until released or closed)."""
        with self.idle(seq):
            seq.pin_ttl = None if seconds is None else time.monotonic() - seq.idle_since + seconds

    def hand_over_drafter(self, source: Sequence, to: Sequence) -> None:
        """Move source's draft index to `to` (a fork of it, working its turn)."""
        with self.lock:
            to.drafter, source.drafter = source.drafter, None

    def use_drafter(self, seq: Sequence, drafter: object) -> None:
        with self.lock:
            seq.drafter = drafter

    def persist(self, seq: Sequence) -> bool:
        """Copy seq's KV to the second tier and keep it there on disk across restarts."""
        with self.idle(seq):
            return self.policy.persist(seq)

    def keep(self, seq: Sequence) -> None:
        # Without the lock: one flag, read by the idle reaper, which never
        # picks a sequence this new. The API's
        # session registry calls this under its own lock, which must never
        # wait for a step (every lease and release would queue behind it).
        seq.kept = True

    def park(self, seq: Sequence) -> None:
        """Move an idle sequence's KV out of the pool (to the second tier and
        the prefix cache); its tokens stay."""
        with self.idle(seq):
            self.policy.evict(seq)

    def close(self, seq: Sequence) -> None:
        """Publish and release; a request still queued or running on it fails."""
        with self.lock:
            if seq.closed:
                return
            self.on_close(seq)
            self.policy.release(seq)
            seq.tokens.clear()
            seq.closed = True
            self.all.discard(seq)
            family = self._families[seq.key]
            family.discard(seq)
            if not family:
                del self._families[seq.key]
            self.policy.forget(seq, bool(family))

    def close_on_collect(self, handle: object, seq: Sequence) -> None:
        """Close seq when its handle is garbage collected (a dropped, unclosed
        session); not at interpreter exit, when its pages may be gone already."""
        weakref.finalize(handle, self._collected, seq).atexit = False

    def _collected(self, seq: Sequence) -> None:
        # Never waits: a collection can run on any thread, the event loop's
        # too, and inside an operation or a step of this very thread (which
        # must not see a sequence vanish halfway), so it only closes now
        # when the lock is free.
        self._dropped.append(seq)
        if not self.lock.held_by_me() and self.lock.acquire(blocking=False):
            try:
                self.close_dropped()
            finally:
                self.lock.release()

    def close_dropped(self) -> None:
        """Close the sequences collected since last asked. The caller holds the lock."""
        while self._dropped:
            self.close(self._dropped.popleft())
