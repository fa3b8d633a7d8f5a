"""The scheduler's requests in flight: waiting (queued, or preempted and
queued again) and running (admitted: holding one of the step's sequence
slots since it last queued)."""
from __future__ import annotations

import itertools

from agentkv.engine.request import Request


class RequestQueue:
    def __init__(self) -> None:
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self.running) + len(self.waiting)

    def all(self) -> list[Request]:
        """Running, then waiting: a copy, safe to change the queue over."""
        return self.running + self.waiting

    def by_priority(self) -> list[Request]:
        return sorted(self.running + self.waiting, key=Request.priority)

    def push(self, req: Request) -> None:
        """A new request waits; its arrival orders it among its sequence's."""
        req.arrival = next(self._arrivals)
        self.waiting.append(req)

    def admit(self, req: Request) -> None:
        req.admitted = True
        self.waiting.remove(req)
        self.running.append(req)

    def requeue(self, req: Request) -> None:
        """A preempted request waits again."""
        if req.admitted:
            req.admitted = False
            self.running.remove(req)
            self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """A finished request leaves, wherever it is."""
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)
