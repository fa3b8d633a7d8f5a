"""A reentrant lock granted in the order it was asked for.

The engine's one lock (engine.sequences) is held by every scheduler step,
forward included, and by every request's start and end. threading.RLock
lets the thread that releases it take it straight back: the scheduler loop
releases it after a step and asks again at once, still holding the GIL, so
a request thread waiting to start or end its turn could lose that race for
several steps. Here a release hands the lock to the longest waiter, so
between two steps everything that asked during the first one runs. (That,
and taking the lock once per turn start and end in engine.turn, gave BFCL
agents back the server time their turns spent waiting for steps:
docs/bench_bfcl_agents.md.)
"""
from __future__ import annotations

import threading
from collections import deque


class FairLock:
    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        # (thread, gate) of each waiter, oldest first; a waiter sleeps on its
        # gate until a release hands it the lock.
        self._waiters: deque[tuple[int, threading.Lock]] = deque()

    def acquire(self, blocking: bool = True) -> bool:
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._waiters:
                self._owner, self._depth = me, 1
                return True
            if not blocking:
                return False
            gate = threading.Lock()
            gate.acquire()
            self._waiters.append((me, gate))
        try:
            gate.acquire()  # released once the lock is ours (release set _owner to us)
        except BaseException:  # interrupted while waiting: give up the place, or the lock if handed over
            with self._mutex:
                handed = (me, gate) not in self._waiters
                if not handed:
                    self._waiters.remove((me, gate))
            if handed:
                self.release()
            raise
        return True

    def release(self) -> None:
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("release of a FairLock this thread does not hold")
            self._depth -= 1
            if self._depth:
                return
            if self._waiters:
                self._owner, gate = self._waiters.popleft()
                self._depth = 1
                gate.release()
            else:
                self._owner = None

    def held_by_me(self) -> bool:
        return self._owner == threading.get_ident()

    @property
    def waiting(self) -> int:
        """Threads waiting for the lock now."""
        return len(self._waiters)

    def __enter__(self) -> "FairLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
