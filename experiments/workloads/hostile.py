"""A hostile tenant for the soak (experiments/soak.py): while the others'
agents run, it does what one key can do to crowd them out or break the
server, over plain HTTP, and counts every status it gets back (0: a connection that ended without one).

Its moves, in turn, until stopped:
- pins: long conversations in named sessions, each retained for the
  server's longest pin (the pool's share they may keep is the policy's);
- floods: new empty sessions until its quota answers 429;
- salts: a long prompt under a new cache_salt each time (a namespace, and
  speculation history, per salt);
- oversized bodies (past --max-request-bytes: 413) and malformed ones (bad
  JSON, wrong types, unknown fields: 400 or 422).
It keeps a few requests in flight at once (threads), not a flood of them:
what it may take is its share of the server, and the soak measures whether
it takes more.
"""
from __future__ import annotations

import itertools
import threading
from collections import Counter

import httpx

LONG = ("Audit every storage shard in region west for stale replicas, list the owners, and draft the "
        "escalation notes for each one that missed its rotation window. ") * 12


class HostileTenant:
    def __init__(self, url: str, key: str, model: str, max_request_bytes: int, retain_s: float, threads: int = 2):
        self.url, self.model, self.max_request_bytes, self.retain_s = url, model, max_request_bytes, retain_s
        self.headers = {"Authorization": f"Bearer {key}"}
        self.statuses: Counter[int] = Counter()
        self.errors: list[str] = []  # transport failures other than the server being down on purpose
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._serial = itertools.count()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True, name=f"hostile-{i}")
                         for i in range(threads)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _run(self, index: int) -> None:
        moves = [self._oversized, self._malformed, self._salt, self._flood, self._pin]
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=600) as http:
            for step in itertools.count(index):
                if self._stop.is_set():
                    return
                moves[step % len(moves)](http)

    def _send(self, http: httpx.Client, method: str, path: str, **kwargs) -> httpx.Response | None:
        """The response; None (counted as status 0) where the connection
        ended without one (a body refused before it was read, or the server
        killed)."""
        try:
            r = http.request(method, path, **kwargs)
        except httpx.TransportError:
            with self._lock:
                self.statuses[0] += 1
            self._stop.wait(0.2)
            return None
        with self._lock:
            self.statuses[r.status_code] += 1
        return r

    def _chat(self, content: str, **extra) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                "temperature": 0.0, **extra}

    def _pin(self, http: httpx.Client) -> None:
        name = f"pin-{next(self._serial) % 6}"
        r = self._send(http, "POST", "/v1/chat/completions", json=self._chat(LONG + name, session_id=name))
        if r is not None and r.status_code == 200:
            self._send(http, "POST", f"/v1/sessions/{name}/retain", json={"seconds": self.retain_s})

    def _flood(self, http: httpx.Client) -> None:
        for _ in range(32):
            r = self._send(http, "POST", "/v1/sessions", json={})
            if r is None or r.status_code != 200 or self._stop.is_set():
                return

    def _salt(self, http: httpx.Client) -> None:
        self._send(http, "POST", "/v1/chat/completions", json=self._chat(LONG, cache_salt=f"s{next(self._serial)}"))

    def _oversized(self, http: httpx.Client) -> None:
        self._send(http, "POST", "/v1/chat/completions", json=self._chat("x" * (self.max_request_bytes + 1)))

    def _malformed(self, http: httpx.Client) -> None:
        self._send(http, "POST", "/v1/chat/completions", content=b'{"model": "x", "messages": [',
                   headers={"Content-Type": "application/json"})
        self._send(http, "POST", "/v1/chat/completions", json={**self._chat("hi"), "max_tokens": "many"})
        self._send(http, "POST", "/v1/chat/completions", json={**self._chat("hi"), "nonsense": True})
        self._send(http, "POST", "/v1/sessions/../../etc/retain", json={"seconds": 1})
