"""Named sessions on disk (serve.py --state-dir): what a restart needs to
resume each one.

One record per session under <state>/sessions (engine.api.json_files): its
tenant, id, namespace, tier key, tokens and turn records, replaced after every
change a lease covered, and only after the session's KV was written through
to the second tier's disk (cache.kv_tier), so a kill -9 at any moment leaves
the last completed state of each session, whose KV is on disk or, where it
is not, is recomputed.

Replicas sharing the folder (engine.api.cluster) read one record at a time
(load_one) and compare stamps (engine.api.json_files) to see whether another
replica has saved a session since. A record's name begins with a digest of
its tenant, so that counting a tenant's sessions on every replica (its
quota) lists the folder and reads nothing.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from agentkv.engine.api.json_files import JsonFiles, Stamp
from agentkv.engine.api.schemas import SESSION_ID_PATTERN, TurnRecord
from agentkv.engine.api.tenants import TENANT_NAME
from agentkv.engine import MessageLog


@dataclass(frozen=True)
class SavedSession:
    tenant: str
    session_id: str
    namespace: str
    key: str
    tokens: list[int]
    turns: list[TurnRecord]
    log: MessageLog | None = None  # which chat messages the tokens are (engine.message_log)


TIER_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_key(key: object) -> str:
    """A tier key names a folder of the disk tier (cache.kv_disk): one of
    its own, never the tier's root or a path out of it."""
    if not isinstance(key, str) or not TIER_KEY.match(key):
        raise ValueError(f"bad tier key {key!r}")
    return key


def check_tokens(tokens: object, vocab_size: int) -> list[int]:
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in tokens):
        raise ValueError("token ids outside the vocabulary")
    return tokens


def _tenant_prefix(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:16] + "-"


def _legacy_name(tenant: str, session_id: str) -> str:
    """One file per (tenant, id): two tenants may use one id."""
    return hashlib.sha256(f"{tenant}\0{session_id}".encode()).hexdigest()[:32]


def _name(tenant: str, session_id: str) -> str:
    return _tenant_prefix(tenant) + _legacy_name(tenant, session_id)


class SessionFiles:
    def __init__(self, root: str | Path):
        self.files = JsonFiles(root, "session")

    @property
    def reports(self) -> list[str]:
        return self.files.reports

    def save(self, s: SavedSession) -> Stamp:
        return self.files.write(_name(s.tenant, s.session_id), {
            "tenant": s.tenant, "id": s.session_id, "namespace": s.namespace, "key": s.key, "tokens": s.tokens,
            "turns": [t.model_dump() for t in s.turns], "log": s.log.to_json() if s.log is not None else None})

    def delete(self, tenant: str, session_id: str) -> None:
        self.files.delete(_name(tenant, session_id))

    def stamp(self, tenant: str, session_id: str) -> Stamp | None:
        return self.files.stamp(_name(tenant, session_id))

    def count(self, tenant: str) -> int:
        """The tenant's saved sessions (of every replica sharing the folder)."""
        return self.files.count(_tenant_prefix(tenant))

    def load(self, vocab_size: int) -> list[SavedSession]:
        saved = list(self.files.read_all(lambda b: _parse(b, vocab_size)))
        for s in saved:  # a folder written before names began with the tenant's digest
            name, legacy = _name(s.tenant, s.session_id), _legacy_name(s.tenant, s.session_id)
            if self.files.stamp(name) is None and self.files.stamp(legacy) is not None:
                self.files.rename(legacy, name)
        return saved

    def load_one(self, tenant: str, session_id: str, vocab_size: int) -> tuple[SavedSession, Stamp] | None:
        """The tenant's saved session and the stamp of what was read; None if none is saved."""
        found = self.files.read(_name(tenant, session_id), lambda b: _parse(b, vocab_size))
        if found is not None and (found[0].tenant, found[0].session_id) != (tenant, session_id):
            return None  # a hash collision of names: not this session
        return found


def _parse(b: dict, vocab_size: int) -> SavedSession:
    if not re.match(SESSION_ID_PATTERN, b["id"]) or not TENANT_NAME.match(b["tenant"]):
        raise ValueError(f"bad session id {b['id']!r} or tenant {b['tenant']!r}")
    tokens = check_tokens(b["tokens"], vocab_size)
    log = MessageLog.from_json(b["log"]) if b.get("log") is not None else None
    if log is not None and log.length + len(log.prepositioned) != len(tokens):
        log = None  # not of these tokens: the session continues template-faithfully once
    return SavedSession(b["tenant"], b["id"], str(b["namespace"]), check_key(b["key"]), tokens,
                        [TurnRecord(**t) for t in b["turns"]], log)
