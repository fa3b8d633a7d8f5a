"""The server's named sessions, each its tenant's, and which of them have a
request in flight.

A session belongs to the tenant that made it: its id (the server's, 128
random bits, or one the client chose) names it within that tenant only, so
two tenants using one id have two sessions, and to any other tenant it does
not exist (404, whether or not the id is in use). Its KV namespace is fixed
when it is made: its tenant's, salted with the request's cache_salt; a later
request with another cache_salt is a 400.

The engine's Session serializes its own calls, but Engine.chat works on a fork
that it adopts at the end: two chats on one session would each run and the
last to finish would win. So the registry hands out leases: a request holds
its session's lease from before it touches the session until the engine call
has returned (a streamed reply whose client went away included), and a second
request for the same session meanwhile gets 409. Reading a session's info
needs no lease.

Replicas sharing one state directory (engine.api.cluster, `shared`): a
session is taken up from its saved record whenever that is newer than what
this replica holds (one it never had, one a failed replica served last, one
another replica has served since), so that any replica can continue any
session from its last completed turn; one deleted elsewhere is gone here too.
A tenant's quota of sessions counts its sessions on every replica (the
records in the shared folder), so a failover, or a ring that spreads one
tenant's sessions, never lets it hold more than its quota.
"""
from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentkv.engine.api.errors import APIError, not_found
from agentkv.engine.api.quotas import check_held
from agentkv.engine.api.schemas import SessionInfo, TurnRecord
from agentkv.engine.api.json_files import Stamp
from agentkv.engine.api.session_files import SavedSession, SessionFiles
from agentkv.engine.api.tenants import Tenant
from agentkv.engine import EngineError, TooManySessionsError

if TYPE_CHECKING:
    from agentkv.engine import Engine, Session

log = logging.getLogger("agentkv.sessions")


def new_session_id() -> str:
    return "sess_" + secrets.token_hex(16)


@dataclass(eq=False)
class _Entry:
    tenant: str
    session_id: str
    session: "Session"
    turns: list[TurnRecord] = field(default_factory=list)
    busy: bool = False
    stamp: Stamp | None = None  # of its saved record, as this replica last wrote or read it

    def __post_init__(self) -> None:
        self.session.keep()  # the idle timeout parks its KV; the id keeps its history


class Lease:
    """Exclusive use of one session; release() is idempotent and thread-safe."""

    def __init__(self, registry: "SessionRegistry", entry: _Entry):
        self.registry, self._entry = registry, entry
        self._released = False
        self._lock = threading.Lock()

    @property
    def session_id(self) -> str:
        return self._entry.session_id

    @property
    def session(self) -> "Session":
        return self._entry.session

    @property
    def turns(self) -> list[TurnRecord]:
        return self._entry.turns

    def record(self, turn: TurnRecord) -> None:
        self._entry.turns.append(turn)

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self.registry.end_lease(self._entry)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SessionRegistry:
    def __init__(self, engine: "Engine", files: SessionFiles | None = None, max_per_tenant: int | None = None,
                 shared: bool = False):
        """max_per_tenant: live sessions one tenant may hold (429 past it).
        shared: other replicas save sessions in files too (see above)."""
        self.engine = engine
        self.files = files
        self.shared = shared and files is not None
        self.max_per_tenant = max_per_tenant
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._lock = threading.Lock()
        self._reports: list[str] = []  # what resume() could not take up

    @property
    def max_retain_s(self) -> float:
        """The longest pin a client may ask for (Limits.max_retain_s)."""
        return self.engine.limits.max_retain_s

    def resume(self) -> set[str]:
        """Take up the sessions an earlier server saved (tokens held, KV
        restored on their next turn from what the disk tier verified).
        Returns the tier keys they claim; what cannot be resumed is in reports()
        (those past the engine's session limit keep their files and KV, for a
        server with a higher limit)."""
        if self.files is None:
            return set()
        saved = self.files.load(self.engine.vocab_size)
        for i, s in enumerate(saved):
            try:
                session = self.engine.session(s.namespace, tokens=s.tokens, key=s.key)
            except TooManySessionsError as e:
                self._reports.append(f"{len(saved) - i} of {len(saved)} saved sessions were not resumed: {e}")
                break
            session.message_log = s.log
            with self._lock:
                self._entries[s.tenant, s.session_id] = _Entry(s.tenant, s.session_id, session, list(s.turns))
        return {s.key for s in saved}

    def end_lease(self, entry: _Entry) -> None:
        """Its session is free for the next request; its state is saved."""
        with self._lock:
            entry.busy = False
        self.save(entry)

    def save(self, entry: _Entry) -> None:
        """Persist the session (with a state directory): KV first, then the file naming it."""
        if self.files is None or entry.session.closed:
            return
        s = entry.session
        try:
            s.save()
            entry.stamp = self.files.save(SavedSession(entry.tenant, entry.session_id, s.namespace, s.key, s.tokens,
                                                       list(entry.turns), s.message_log))
        except (EngineError, OSError) as e:  # the session serves on; only its saved copy is stale
            log.warning("session %s of tenant %s was not saved: %s", entry.session_id, entry.tenant, e)

    def reports(self) -> list[str]:
        """What resuming saved state found wrong (unreadable files, KV that failed verification)."""
        return (self.files.reports if self.files else []) + self._reports + self.engine.kv_reports

    def list(self, tenant: Tenant) -> list[SessionInfo]:
        with self._lock:
            ids = [session_id for owner, session_id in self._entries if owner == tenant.name]
        out = []
        for session_id in ids:
            try:
                out.append(self.info(tenant, session_id))
            except APIError:  # closed meanwhile
                pass
        return out

    def __len__(self) -> int:
        return len(self._entries)

    def sessions_of(self, tenant: Tenant) -> list["Session"]:
        with self._lock:
            return [e.session for (owner, _), e in self._entries.items() if owner == tenant.name]

    def _take_up(self, tenant: str, session_id: str) -> None:
        """With shared files: hold the session as it was last saved, if that
        is not what this replica holds (see the module's docstring)."""
        if not self.shared:
            return
        with self._lock:
            entry = self._live(tenant, session_id)
            if entry is not None and entry.busy:
                return  # its lease's holder is serving it here
        stamp = self.files.stamp(tenant, session_id)
        if stamp is None or (entry is not None and stamp == entry.stamp):
            if stamp is None and entry is not None and entry.stamp is not None:
                self._forget_deleted(entry)
            return
        found = self.files.load_one(tenant, session_id, self.engine.vocab_size)
        if found is None:
            return
        saved, stamp = found
        self.engine.adopt_saved_kv(saved.key)
        session = self.engine.session(saved.namespace, tokens=saved.tokens, key=saved.key)
        session.message_log = saved.log
        with self._lock:
            current = self._live(tenant, session_id)
            if current is not None and (current.busy or current.stamp == stamp):
                stale = session  # taken up or leased meanwhile
            else:
                stale = current.session if current is not None else None
                self._entries[tenant, session_id] = _Entry(tenant, session_id, session, list(saved.turns), stamp=stamp)
        if stale is not None:
            stale.close()

    def _forget_deleted(self, entry: _Entry) -> None:
        with self._lock:
            if self._entries.get((entry.tenant, entry.session_id)) is not entry or entry.busy:
                return
            del self._entries[entry.tenant, entry.session_id]
        entry.session.close()

    def create(self, tenant: Tenant, session_id: str | None = None, cache_salt: str | None = None) -> str:
        session_id = session_id or new_session_id()
        self._take_up(tenant.name, session_id)
        self._add(tenant, session_id, tenant.namespace(cache_salt), exists_ok=False).release()
        return session_id

    def lease(self, tenant: Tenant, session_id: str, create: bool = False, cache_salt: str | None = None) -> Lease:
        """Take the tenant's session (made empty on first use with create, in
        the namespace of cache_salt); 404 if unknown, 409 if busy, 400 if it
        was made with another cache_salt."""
        namespace = tenant.namespace(cache_salt)
        self._take_up(tenant.name, session_id)
        with self._lock:
            entry = self._live(tenant.name, session_id)
            if entry is None and not create:
                raise _unknown(session_id)
            if entry is not None:
                return self._take(entry, namespace if create else None)
        return self._add(tenant, session_id, namespace, exists_ok=True)

    def _add(self, tenant: Tenant, session_id: str, namespace: str, exists_ok: bool) -> Lease:
        # Made outside the registry's lock: making a session waits for the
        # engine's, which a step holds, and nothing else should wait behind it.
        with self._lock:
            self._check_quota(tenant.name)
        session = self.engine.session(namespace)
        try:
            with self._lock:
                entry = self._live(tenant.name, session_id)
                if entry is None:
                    self._check_quota(tenant.name)
                    entry = self._entries[tenant.name, session_id] = _Entry(tenant.name, session_id, session)
                    session = None
                elif not exists_ok:
                    raise APIError(409, f"session {session_id!r} already exists", code="session_exists",
                                   param="session_id")
                return self._take(entry, namespace)
        finally:
            if session is not None:  # another request made it first, or the tenant is at its quota
                session.close()

    def _check_quota(self, tenant: str) -> None:
        if self.max_per_tenant is None:
            return
        live = [e for (owner, _), e in self._entries.items() if owner == tenant and not e.session.closed]
        if self.shared:
            # Every replica's sessions of the tenant count, taken up here or not:
            # those any replica saved, and those begun here and not saved yet.
            held = self.files.count(tenant) + sum(e.stamp is None for e in live)
        else:
            held = len(live)
        check_held("live sessions", held, self.max_per_tenant, "delete one (DELETE /v1/sessions/{id}) first")

    def _take(self, entry: _Entry, namespace: str | None) -> Lease:
        if namespace is not None and entry.session.namespace != namespace:
            raise APIError(400, f"session {entry.session_id!r} was made with another cache_salt", param="cache_salt")
        if entry.busy:
            raise APIError(409, f"session {entry.session_id!r} already has a request in flight", code="session_busy")
        entry.busy = True
        return Lease(self, entry)

    def _live(self, tenant: str, session_id: str) -> _Entry | None:
        """The entry, unless its session was closed behind the registry's back
        (its handle's close()): then the entry goes too."""
        entry = self._entries.get((tenant, session_id))
        if entry is not None and entry.session.closed:
            del self._entries[tenant, session_id]
            return None
        return entry

    def fork(self, tenant: Tenant, session_id: str) -> str:
        """A new session of the tenant sharing the source's pages (copy-on-write) and its turn history."""
        with self.lease(tenant, session_id) as lease:
            with self._lock:
                self._check_quota(tenant.name)
            new_id = new_session_id()
            child = _Entry(tenant.name, new_id, lease.session.fork(), list(lease.turns))
        with self._lock:
            self._entries[tenant.name, new_id] = child
        self.save(child)
        return new_id

    def delete(self, tenant: Tenant, session_id: str) -> None:
        with self.lease(tenant, session_id) as lease:
            with self._lock:
                del self._entries[tenant.name, session_id]
            if self.files is not None:
                self.files.delete(tenant.name, session_id)
                lease.session.forget_saved()
            lease.session.close()

    def info(self, tenant: Tenant, session_id: str) -> SessionInfo:
        self._take_up(tenant.name, session_id)
        with self._lock:
            entry = self._live(tenant.name, session_id)
        if entry is None:
            raise _unknown(session_id)
        s = entry.session
        return SessionInfo(
            id=session_id, length=len(s), pages=s.pages_held, busy=entry.busy, pinned=s.pinned,
            awaiting_tools=list(s.awaiting) if s.awaiting else None, tier_tokens=s.tier_tokens, turns=list(entry.turns),
        )

    def busy_count(self) -> int:
        return sum(entry.busy for entry in list(self._entries.values()))

    def close_all(self) -> None:
        """Release every session's pages (at shutdown, once no request is in flight)."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            entry.session.close()


def _unknown(session_id: str) -> APIError:
    return not_found(f"no session {session_id!r}", "session_not_found", "session_id")
