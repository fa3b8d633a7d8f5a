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

Retention: a tenant may hold at most `max_per_tenant`, those it is
generating with store=true included (one more is a 429, before anything is
computed: none of its responses is expired to make room), and the store at
most `max_responses`; past that the least recently used response of the
tenant holding the most expires (its session closes), so that no tenant's use
expires another's responses while it holds more. An expired id answers 404
with code response_expired, saying why (the ids of the last `max_responses`
expired are remembered), not as one that never existed. The responses
continued from an expired one keep working: each holds its own session, and
the conversation's messages stay reachable through them.

With a state directory (engine.api.response_files) each stored response is
saved as it is stored, and a new store resumes what an earlier one saved.
Replicas sharing the directory (engine.api.cluster, share()) take up on
first use a response another replica stored, and drop one deleted there.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentkv.engine.api.errors import not_found
from agentkv.engine.api.quotas import check_held
from agentkv.engine.api.response_files import ResponseFiles, SavedResponse
from agentkv.engine.api.responses_schemas import Response
from agentkv.engine import EngineError

if TYPE_CHECKING:
    from agentkv.engine import Engine, Session

log = logging.getLogger("agentkv.responses")


@dataclass(eq=False)
class StoredResponse:
    response: Response
    tenant: str
    input_items: list[dict]  # this request's items, with ids
    messages: list[dict]  # this turn's chat messages: its input's, then the reply
    previous: "StoredResponse | None"
    session: "Session"
    lock: threading.Lock = field(default_factory=threading.Lock)
    deleted: bool = False

    def __post_init__(self) -> None:
        self.session.keep()  # the idle timeout parks its KV; a continuation still finds it

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


def _expired(response_id: str, limit: int):
    return not_found(f"response {response_id!r} expired: the server keeps {limit} stored responses "
                     "(--max-stored-responses) and it was the least recently used of the tenant holding the most; "
                     "send the whole conversation instead", "response_expired", "previous_response_id")


DEFAULT_MAX_RESPONSES = 4096


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, files: ResponseFiles | None = None,
                 max_per_tenant: int | None = None) -> None:
        if max_responses < 1:
            raise ValueError("max_responses must be at least 1")
        self.max_responses = max_responses
        self.max_per_tenant = max_per_tenant
        self.files = files
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._held: Counter[str] = Counter()  # stored responses by tenant
        self._storing: Counter[str] = Counter()  # store=true responses generating, by tenant
        self._expired: OrderedDict[str, str] = OrderedDict()  # expired ids (the last max_responses): their tenants
        self._lock = threading.Lock()
        self._closed = False
        self._running = 0
        self._order = itertools.count()
        self._shared_with: "Engine | None" = None

    def share(self, engine: "Engine") -> None:
        """Other replicas save responses in these files too: take theirs up on first use."""
        if self.files is not None:
            self._shared_with = engine
            self._order = itertools.count(time.time_ns())  # orders records of every replica by time

    def resume(self, engine: "Engine") -> set[str]:
        """Take up the responses an earlier server saved; the tier keys they claim."""
        if self.files is None:
            return set()
        saved = self.files.load(engine.vocab_size)
        self._order = itertools.count(saved[-1].order + 1 if saved else 0)  # what is saved next is newer
        for s in saved[-self.max_responses:]:
            self._hold(engine, s)
        for s in saved[: -self.max_responses]:
            self.files.delete(s.response["id"])
            with self._lock:
                self._bury(s.response["id"], s.tenant)
        with self._lock:
            return {e.session.key for e in self._entries.values()}

    def _hold(self, engine: "Engine", s: SavedResponse) -> None:
        session = engine.session(s.namespace, tokens=s.tokens, key=s.key, counted=False)
        session.message_log = s.log
        entry = StoredResponse(Response.model_validate(s.response), s.tenant, s.input_items, s.conversation,
                               None, session)
        with self._lock:
            if entry.id in self._entries:  # taken up meanwhile
                extra = entry
            else:
                extra = None
                self._entries[entry.id] = entry
                self._held[entry.tenant] += 1
        if extra is not None:
            extra.close()

    def _take_up(self, response_id: str) -> None:
        """With shared files: a response another replica stored, held here
        from its record; one deleted there, dropped here."""
        engine = self._shared_with
        with self._lock:
            held = response_id in self._entries
        if held:
            if not self.files.saved(response_id):
                with self._lock:
                    entry = self._entries.pop(response_id, None)
                    if entry is not None:
                        self._uncount(entry.tenant)
                if entry is not None:
                    entry.close()
            return
        saved = self.files.load_one(response_id, engine.vocab_size)
        if saved is None:
            return
        engine.adopt_saved_kv(saved.key)
        self._hold(engine, saved)
        with self._lock:
            expired = [self._expire_one(max(self._held, key=self._held.__getitem__))
                       for _ in range(len(self._entries) - self.max_responses)]
        for old in expired:
            self._forget(old)

    def _save(self, entry: StoredResponse) -> None:
        if self.files is None:
            return
        s = entry.session
        try:
            s.save()
            self.files.save(SavedResponse(entry.response.model_dump(mode="json"), entry.tenant, s.namespace,
                                          entry.input_items,
                                          entry.conversation(), s.key, s.tokens, next(self._order), s.message_log))
        except (EngineError, OSError) as e:  # it serves on; only its saved copy is missing
            log.warning("response %s was not saved: %s", entry.id, e)

    def _forget(self, entry: StoredResponse) -> None:
        """An expired or deleted response: its file goes, and its KV unless another stored response shares it."""
        entry.close()
        if self.files is None:
            return
        self.files.delete(entry.id)
        with self._lock:
            shared = any(e.session.key == entry.session.key for e in self._entries.values())
        if not shared:
            entry.session.forget_saved()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def running(self) -> int:
        """Requests generating a response now (the server drains them before closing the store)."""
        return self._running

    def sessions_of(self, tenant: str) -> list["Session"]:
        with self._lock:
            return [e.session for e in self._entries.values() if e.tenant == tenant]

    def enter(self, storing: str | None) -> None:
        """A response begins generating (leave(storing) when it is finished);
        storing: the tenant it is stored for (store=true), a 429 if that
        tenant holds as many responses as it may, counting those it is
        generating, before anything is computed."""
        with self._lock:
            if storing is not None:
                check_held("stored responses", self._held[storing] + self._storing[storing], self.max_per_tenant,
                           "delete one (DELETE /v1/responses/{id}) or send store=false")
                self._storing[storing] += 1
            self._running += 1

    def leave(self, storing: str | None) -> None:
        with self._lock:
            self._running -= 1
            if storing is not None:
                self._storing[storing] -= 1
                if not self._storing[storing]:
                    del self._storing[storing]

    def get(self, response_id: str, tenant: str) -> StoredResponse:
        if self._shared_with is not None:
            self._take_up(response_id)
        with self._lock:
            entry = self._lookup(response_id, tenant)
            self._entries.move_to_end(response_id)
            return entry

    def _lookup(self, response_id: str, tenant: str) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None and self._expired.get(response_id) == tenant:
            raise _expired(response_id, self.max_responses)
        if entry is None or entry.tenant != tenant:
            raise _missing(response_id)
        return entry

    def put(self, entry: StoredResponse) -> None:
        expired: list[StoredResponse] = []
        with self._lock:
            closed = self._closed
            if not closed:
                self._entries[entry.id] = entry
                self._held[entry.tenant] += 1
                while len(self._entries) > self.max_responses:
                    expired.append(self._expire_one(max(self._held, key=self._held.__getitem__)))
        if closed:  # the server is shutting down: nobody can continue it
            entry.close()
        else:
            self._save(entry)
        for old in expired:
            self._forget(old)

    def delete(self, response_id: str, tenant: str) -> None:
        if self._shared_with is not None:
            self._take_up(response_id)
        with self._lock:
            entry = self._lookup(response_id, tenant)
            del self._entries[response_id]
            self._uncount(entry.tenant)
        self._forget(entry)

    def _expire_one(self, tenant: str) -> StoredResponse:
        """The tenant's least recently used response, out of the store (its id remembered as expired)."""
        response_id = next(k for k, e in self._entries.items() if e.tenant == tenant)
        self._uncount(tenant)
        self._bury(response_id, tenant)
        return self._entries.pop(response_id)

    def _bury(self, response_id: str, tenant: str) -> None:
        self._expired[response_id] = tenant
        while len(self._expired) > self.max_responses:
            self._expired.popitem(last=False)

    def _uncount(self, tenant: str) -> None:
        self._held[tenant] -= 1
        if not self._held[tenant]:
            del self._held[tenant]

    def close_all(self) -> None:
        with self._lock:
            entries, self._entries, self._closed = list(self._entries.values()), OrderedDict(), True
            self._held.clear()
        for entry in entries:
            entry.close()
