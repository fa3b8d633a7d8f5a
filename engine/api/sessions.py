"""The server's named sessions, and which of them have a request in flight.

The engine's Session serializes its own calls, but Engine.chat works on a fork
that it adopts at the end: two chats on one session would each run and the
last to finish would win. So the registry hands out leases: a request holds
its session's lease from before it touches the session until the engine call
has returned (a streamed reply whose client went away included), and a second
request for the same session meanwhile gets 409. Reading a session's info
needs no lease.
"""
from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.api.errors import APIError, not_found
from engine.api.schemas import SessionInfo, TurnRecord
from engine.api.session_files import SavedSession, SessionFiles
from engine.errors import EngineError

if TYPE_CHECKING:
    from engine import Engine, Session

log = logging.getLogger("agentkv.sessions")


@dataclass(eq=False)
class _Entry:
    session: "Session"
    turns: list[TurnRecord] = field(default_factory=list)
    busy: bool = False


class Lease:
    """Exclusive use of one session; release() is idempotent and thread-safe."""

    def __init__(self, registry: "SessionRegistry", session_id: str, entry: _Entry):
        self.registry, self.session_id, self._entry = registry, session_id, entry
        self._released = False

    @property
    def session(self) -> "Session":
        return self._entry.session

    @property
    def turns(self) -> list[TurnRecord]:
        return self._entry.turns

    def record(self, turn: TurnRecord) -> None:
        self._entry.turns.append(turn)

    def release(self) -> None:
        with self.registry._lock:
            if self._released:
                return
            self._released = True
            self._entry.busy = False
        self.registry.save(self.session_id, self._entry)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SessionRegistry:
    def __init__(self, engine: "Engine", namespace: str = "default", files: SessionFiles | None = None):
        self.engine = engine
        self.namespace = namespace
        self.files = files
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def resume(self) -> set[str]:
        """Take up the sessions an earlier server saved (tokens held, KV
        restored on their next turn from what the disk tier verified).
        Returns the tier keys they claim; what cannot be resumed is in reports()."""
        if self.files is None:
            return set()
        saved = self.files.load(self.engine.model.cfg.vocab_size)
        for s in saved:
            session = self.engine.session(s.namespace, tokens=s.tokens, key=s.key)
            with self._lock:
                self._entries[s.session_id] = _Entry(session, list(s.turns))
        return {s.key for s in saved}

    def save(self, session_id: str, entry: _Entry) -> None:
        """Persist the session (with a state directory): KV first, then the file naming it."""
        if self.files is None or entry.session.closed:
            return
        s = entry.session
        try:
            s.save()
            self.files.save(SavedSession(session_id, s.namespace, s.key, s.tokens, list(entry.turns)))
        except (EngineError, OSError) as e:  # the session serves on; only its saved copy is stale
            log.warning("session %s was not saved: %s", session_id, e)

    def reports(self) -> list[str]:
        """What resuming saved state found wrong (unreadable files, KV that failed verification)."""
        tier = self.engine.tier
        return (self.files.reports if self.files else []) + (list(tier.reports) if tier is not None else [])

    def list(self) -> list[SessionInfo]:
        with self._lock:
            ids = list(self._entries)
        out = []
        for session_id in ids:
            try:
                out.append(self.info(session_id))
            except APIError:  # closed meanwhile
                pass
        return out

    def __len__(self) -> int:
        return len(self._entries)

    def create(self, session_id: str | None = None) -> str:
        session_id = session_id or "sess_" + secrets.token_hex(12)
        self._add(session_id, exists_ok=False).release()
        return session_id

    def lease(self, session_id: str, create: bool = False) -> Lease:
        """Take the session (made empty on first use with create); 404 if unknown, 409 if busy."""
        with self._lock:
            entry = self._live(session_id)
            if entry is None and not create:
                raise not_found(f"no session {session_id!r}", "session_not_found", "session_id")
            if entry is not None:
                return self._take(session_id, entry)
        return self._add(session_id, exists_ok=True)

    def _add(self, session_id: str, exists_ok: bool) -> Lease:
        # Made outside the registry's lock: making a session waits for the
        # engine's, which a step holds, and nothing else should wait behind it.
        session = self.engine.session(self.namespace)
        try:
            with self._lock:
                entry = self._live(session_id)
                if entry is None:
                    self._prune()
                    entry = self._entries[session_id] = _Entry(session)
                    session = None
                elif not exists_ok:
                    raise APIError(409, f"session {session_id!r} already exists", code="session_exists",
                                   param="session_id")
                return self._take(session_id, entry)
        finally:
            if session is not None:  # another request made it first
                session.close()

    def _take(self, session_id: str, entry: _Entry) -> Lease:
        if entry.busy:
            raise APIError(409, f"session {session_id!r} already has a request in flight", code="session_busy")
        entry.busy = True
        return Lease(self, session_id, entry)

    def _live(self, session_id: str) -> _Entry | None:
        """The entry, unless its session was closed by the engine (idle timeout,
        session limit): then the entry goes too."""
        entry = self._entries.get(session_id)
        if entry is not None and entry.session.closed:
            del self._entries[session_id]
            return None
        return entry

    def _prune(self) -> None:
        """Past the engine's session limit, forget the entries of closed sessions."""
        if len(self._entries) >= self.engine.limits.max_sessions:
            for session_id in [k for k, e in self._entries.items() if e.session.closed]:
                del self._entries[session_id]

    def fork(self, session_id: str) -> str:
        """A new session sharing the source's pages (copy-on-write) and its turn history."""
        with self.lease(session_id) as lease:
            child = _Entry(lease.session.fork(), list(lease.turns))
        new_id = "sess_" + secrets.token_hex(12)
        with self._lock:
            self._entries[new_id] = child
        self.save(new_id, child)
        return new_id

    def delete(self, session_id: str) -> None:
        with self.lease(session_id) as lease:
            with self._lock:
                del self._entries[session_id]
            if self.files is not None:
                self.files.delete(session_id)
                lease.session.forget_saved()
            lease.session.close()

    def info(self, session_id: str) -> SessionInfo:
        with self._lock:
            entry = self._live(session_id)
        if entry is None:
            raise not_found(f"no session {session_id!r}", "session_not_found", "session_id")
        s = entry.session
        tier = self.engine.tier
        return SessionInfo(
            id=session_id, length=len(s), pages=len(s.table.held_pages()), busy=entry.busy, pinned=s.pinned,
            awaiting_tools=list(s.awaiting) if s.awaiting else None,
            tier_tokens=tier.tokens_held(s.key) if tier is not None else 0, turns=list(entry.turns),
        )

    def busy_count(self) -> int:
        return sum(entry.busy for entry in list(self._entries.values()))

    def close_all(self) -> None:
        """Release every session's pages (at shutdown, once no request is in flight)."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            entry.session.close()
