"""Who is asking: API keys and the tenants they name.

A tenant is the unit of isolation: its sessions, stored responses and KV
(the prefix cache's namespace) are its own, and its quotas are counted
apart from every other tenant's. Without keys configured the server is
open: every request is the one tenant "default" (local use).

Keys come from `--api-key KEY` (each its own tenant, named after a hash of
the key so that the name can be logged) and `--api-keys-file FILE` (lines of
`key tenant-name`; several keys may name one tenant, e.g. while rotating
one; `#` starts a comment). The file is read again on reload() (SIGHUP); a
file that does not parse leaves the keys as they were. Keys are compared in
constant time and never logged.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request

OPEN_TENANT = "default"
TENANT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_SALT_CHARS = 256


@dataclass(frozen=True)
class Tenant:
    name: str

    def namespace(self, cache_salt: str | None = None) -> str:
        """The KV namespace of this tenant's requests: nothing is matched
        across namespaces, so neither across tenants nor across salts.
        Tenant names have no ":", so no tenant's namespace is another's, and
        the engine's owner_of (engine.sequence) names the tenant."""
        return self.name if cache_salt is None else f"{self.name}:{cache_salt}"


class ApiKeysError(ValueError):
    pass


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_tenant_name(key: str) -> str:
    """The tenant of a key given on the command line: a name that can be
    logged without revealing the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_keys_file(path: str | Path) -> dict[str, str]:
    """key -> tenant name, from lines of `key tenant-name`."""
    keys: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ApiKeysError(f"{path}:{number}: expected `key tenant-name`")
        key, name = fields
        if not TENANT_NAME.match(name):
            raise ApiKeysError(f"{path}:{number}: a tenant name is 1-64 of A-Z a-z 0-9 . _ -")
        if key in keys:
            raise ApiKeysError(f"{path}:{number}: this key is listed twice")
        keys[key] = name
    return keys


class ApiKeys:
    def __init__(self, named: dict[str, str] | None = None, file: str | Path | None = None):
        """named: key -> tenant name; file: more of them, read again on reload()."""
        self.file = Path(file) if file is not None else None
        self._named = dict(named or {})
        if "" in self._named:
            raise ApiKeysError("an API key must not be empty")
        self._lock = threading.Lock()
        self._entries: list[tuple[bytes, Tenant]] = []
        self.reload()

    @classmethod
    def from_args(cls, keys: list[str], file: str | Path | None = None) -> "ApiKeys":
        """serve.py's --api-key (each its own tenant) and --api-keys-file."""
        return cls({key: key_tenant_name(key) for key in keys}, file)

    def reload(self) -> None:
        """Read the keys file again; raises ApiKeysError, changing nothing, if it does not parse."""
        keys = dict(self._named)
        if self.file is not None:
            for key, name in parse_keys_file(self.file).items():
                if key in keys and keys[key] != name:
                    raise ApiKeysError(f"{self.file}: a key given on the command line names another tenant here")
                keys[key] = name
        if not keys and (self.file is not None or self._named):
            # A server started with keys never opens: an emptied keys file is a mistake, not "let everyone in".
            raise ApiKeysError(f"{self.file}: no keys; a server started with keys keeps at least one")
        entries = [(_digest(key), Tenant(name)) for key, name in keys.items()]
        with self._lock:
            self._entries = entries

    @property
    def open(self) -> bool:
        """No keys: every request is the default tenant."""
        with self._lock:
            return not self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an `Authorization: Bearer KEY` header, None if the key
        is missing or unknown. Every key is compared (in constant time, on
        digests of equal length) so that the time taken says nothing about
        which keys exist or how much of one was guessed."""
        with self._lock:
            entries = self._entries
        if not entries:
            return Tenant(OPEN_TENANT)
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest, found = _digest(key.strip()), None
        for known, tenant in entries:
            if hmac.compare_digest(known, digest):
                found = tenant
        return found


def tenant_of(request: Request) -> Tenant:
    """The tenant the gate (engine.api.gate) authenticated for this request."""
    return request.state.tenant
