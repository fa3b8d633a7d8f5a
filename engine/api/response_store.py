"""Stored responses: each keeps the session its reply ended in, so that a
continuation (previous_response_id) forks that session and appends only the
new turn's tokens.

A session per stored response costs little: a fork shares every page with the
session it came from, and copies (on its first write) only the partially
filled last one. Idle sessions are parked by the engine's usual policy
(pin_ttl, engine.kv_policy): their pages go to the prefix cache, their
tokens stay, and the next fork re-matches them (what is no longer cached is
recomputed). A response belongs to the tenant that made it: to any other one
it does not exist (404).

Retention: the store keeps at most `max_responses`; past that the least
recently used one expires (its session closes, its id answers 404). The
responses continued from it keep working: each holds its own session, and the
conversation's messages stay reachable through them.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.api.errors import not_found
from engine.api.held_text import HeldText
from engine.api.responses_schemas import Response

if TYPE_CHECKING:
    from engine import Session


@dataclass(eq=False)
class StoredResponse:
    response: Response
    tenant: str
    input_items: list[dict]  # this request's items, with ids
    messages: list[dict]  # this turn's chat messages: its input's, then the reply
    previous: "StoredResponse | None"
    held: HeldText  # what the session's tokens spell
    session: "Session"
    lock: threading.Lock = field(default_factory=threading.Lock)
    deleted: bool = False

    @property
    def id(self) -> str:
        return self.response.id

    def conversation(self) -> list[dict]:
        """Every message up to and including this response's reply (instructions excepted, as at OpenAI)."""
        turns, node = [], self
        while node is not None:
            turns.append(node.messages)
            node = node.previous
        return [m for turn in reversed(turns) for m in turn]

    def fork(self) -> "Session":
        """A session at this response's end, for a continuation to extend."""
        with self.lock:
            if self.deleted:
                raise _missing(self.id)
            return self.session.fork_for_turn()

    def close(self) -> None:
        with self.lock:
            self.deleted = True
            self.session.close()


def _missing(response_id: str):
    return not_found(f"no response {response_id!r}", "response_not_found", "previous_response_id")


DEFAULT_MAX_RESPONSES = 4096


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError("max_responses must be at least 1")
        self.max_responses = max_responses
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._closed = False
        self._running = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def running(self) -> int:
        """Requests generating a response now (the server drains them before closing the store)."""
        return self._running

    def enter(self) -> None:
        """A response has begun generating (leave() when it is finished)."""
        with self._lock:
            self._running += 1

    def leave(self) -> None:
        with self._lock:
            self._running -= 1

    def get(self, response_id: str, tenant: str) -> StoredResponse:
        with self._lock:
            entry = self._lookup(response_id, tenant)
            self._entries.move_to_end(response_id)
            return entry

    def _lookup(self, response_id: str, tenant: str) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None or entry.tenant != tenant:
            raise _missing(response_id)
        return entry

    def put(self, entry: StoredResponse) -> None:
        expired: list[StoredResponse] = []
        with self._lock:
            closed = self._closed
            if not closed:
                self._entries[entry.id] = entry
                while len(self._entries) > self.max_responses:
                    expired.append(self._entries.popitem(last=False)[1])
        if closed:  # the server is shutting down: nobody can continue it
            expired.append(entry)
        for old in expired:
            old.close()

    def delete(self, response_id: str, tenant: str) -> None:
        with self._lock:
            entry = self._lookup(response_id, tenant)
            del self._entries[response_id]
        entry.close()

    def close_all(self) -> None:
        with self._lock:
            entries, self._entries, self._closed = list(self._entries.values()), {}, True
        for entry in entries:
            entry.close()
