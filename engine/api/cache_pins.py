"""The prefixes clients asked to have kept (the Messages API's cache_control
breakpoints), each held by a session of its own that shares the pages of
the turn that computed it (Session.hold_prefix): pinned for its TTL, not
counted against the session limit, in its tenant's namespace, so that the
prefix cache finds it for the tenant's next requests.

The pins are soft: under memory pressure they give way after everything
unpinned, a tenant's pins beyond its share of the pool first
(engine.kv_policy). A prefix marked again replaces its holder, so its TTL
starts again (Anthropic refreshes a cache entry on each use). Holders past
their TTL are closed as new ones come, and the oldest of a tenant's past
MAX_PINS_PER_TENANT; their KV is left to the prefix cache, unused, the first
to go. A tenant's KV quota counts what its holders hold.
"""
from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Callable

from agentkv.engine import Session

# Four breakpoints a request, for a few conversations at once.
MAX_PINS_PER_TENANT = 32


@dataclass
class _Pin:
    tenant: str
    session: Session
    expires: float


class CachePins:
    def __init__(self, max_per_tenant: int = MAX_PINS_PER_TENANT, clock: Callable[[], float] = time.monotonic):
        self.max_per_tenant, self.clock = max_per_tenant, clock
        self._pins: dict[tuple[str, bytes], _Pin] = {}  # (namespace, digest of the prefix) -> its holder, oldest first
        self._lock = threading.Lock()

    def hold(self, tenant: str, session: Session, length: int, seconds: float) -> None:
        """Keep session's first `length` tokens for `seconds` (session must be idle)."""
        key = (session.namespace, _digest(session.tokens[:length]))
        pin = _Pin(tenant, session.hold_prefix(length, seconds), self.clock() + seconds)
        with self._lock:
            gone = [p.session for p in [self._pins.pop(key, None)] if p is not None]
            self._pins[key] = pin
            gone += self._sweep(tenant)
        for s in gone:
            s.close()

    def _sweep(self, tenant: str) -> list[Session]:
        """Take out the holders past their TTL, and tenant's oldest beyond its limit."""
        now = self.clock()
        expired = [k for k, p in self._pins.items() if p.expires <= now or p.session.closed]
        own = [k for k, p in self._pins.items() if p.tenant == tenant and k not in expired]
        return [self._pins.pop(k).session for k in expired + own[: max(0, len(own) - self.max_per_tenant)]]

    def sessions_of(self, tenant: str) -> list[Session]:
        with self._lock:
            return [p.session for p in self._pins.values() if p.tenant == tenant]

    def close_all(self) -> None:
        with self._lock:
            pins, self._pins = list(self._pins.values()), {}
        for p in pins:
            p.session.close()


def _digest(tokens: list[int]) -> bytes:
    return hashlib.blake2b(repr(tokens).encode(), digest_size=16).digest()
