"""A hostile tenant for the soak (experiments/soak.py): while the others'
agents run, it does what one key can do to crowd them out or break the
server, at its full quotas, over plain HTTP, and counts every status it
gets back (0: a connection that ended without one).

Its moves, in turn, on as many threads as its concurrency quota
(--tenant-max-concurrent) lets it keep in flight, until stopped:
- bodies at the size limit (--max-request-bytes): exactly at it, padded
  with JSON whitespace (served), and one byte past it (413);
- pathological tool schemas: an enum of thousands of values filling the
  body, and parameters nested hundreds and thousands of levels deep,
  with tool_choice "required" so that the grammar must hold them;
- session churn: a named session made, served a turn, deleted, again;
- pins: long conversations in named sessions, each retained for the
  server's longest pin (the pool's share they may keep is the policy's);
- floods: new empty sessions until its quota answers 429, then all deleted;
- salts: a long prompt under a new cache_salt each time (a namespace, and
  speculation history, per salt);
- malformed bodies (bad JSON, wrong types, unknown fields: 400 or 422).
"""
from __future__ import annotations

import itertools
import json
import threading
from collections import Counter

import httpx

LONG = ("Audit every storage shard in region west for stale replicas, list the owners, and draft the "
        "escalation notes for each one that missed its rotation window. ") * 12
DEPTHS = (200, 5000)  # nesting of a tool's parameters: deep, and past any recursion limit


def nested_schema(depth: int) -> str:
    """An object schema `depth` levels deep, as JSON text (past Python's
    recursion limit, json.dumps cannot write it)."""
    head = '{"type": "object", "properties": {"x": '
    return head * depth + '{"type": "string"}' + '}, "required": ["x"]}' * depth


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": "look it up", "parameters": parameters}}


class HostileTenant:
    def __init__(self, url: str, key: str, model: str, max_request_bytes: int, retain_s: float, threads: int):
        self.url, self.model, self.max_request_bytes, self.retain_s = url, model, max_request_bytes, retain_s
        self.headers = {"Authorization": f"Bearer {key}"}
        self.statuses: Counter[int] = Counter()
        self.moves: Counter[str] = Counter()  # move -> status -> count, as "move status"
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
            t.join(300)

    def _run(self, index: int) -> None:
        moves = [self._at_limit, self._huge_enum, self._churn, self._deep, self._oversized, self._pin, self._salt,
                 self._flood, self._malformed]
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=600) as http:
            for step in itertools.count(index):
                if self._stop.is_set():
                    return
                moves[step % len(moves)](http)

    def _send(self, http: httpx.Client, move: str, method: str, path: str, **kwargs) -> httpx.Response | None:
        """The response; None (counted as status 0) where the connection
        ended without one (a body refused before it was read, or the server
        killed)."""
        try:
            r = http.request(method, path, **kwargs)
        except httpx.TransportError:
            status, r = 0, None
        else:
            status = r.status_code
        with self._lock:
            self.statuses[status] += 1
            self.moves[f"{move} {status}"] += 1
        if r is None:
            self._stop.wait(0.2)
        return r

    def _chat(self, content: str, **extra) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 16,
                "temperature": 0.0, **extra}

    def _raw(self, body: dict, size: int) -> bytes:
        """body as JSON, padded with whitespace to exactly size bytes."""
        data = json.dumps(body).encode()
        if len(data) > size:
            raise ValueError(f"a body of {len(data)} bytes does not fit in {size}")
        return data[:-1] + b" " * (size - len(data)) + data[-1:]

    def _at_limit(self, http: httpx.Client) -> None:
        body = self._raw(self._chat("Summarize the incident log."), self.max_request_bytes)
        self._send(http, "at_limit", "POST", "/v1/chat/completions", content=body,
                   headers={"Content-Type": "application/json"})

    def _oversized(self, http: httpx.Client) -> None:
        body = self._raw(self._chat("Summarize the incident log."), self.max_request_bytes + 1)
        self._send(http, "oversized", "POST", "/v1/chat/completions", content=body,
                   headers={"Content-Type": "application/json"})

    def _huge_enum(self, http: httpx.Client) -> None:
        # As many values as the body limit leaves room for (each 18 bytes in JSON).
        values = [f"region-{i:07d}" for i in range((self.max_request_bytes - 4096) // 20)]
        params = {"type": "object", "properties": {"region": {"type": "string", "enum": values}},
                  "required": ["region"]}
        body = self._chat("Which region is on fire?", tools=[tool("lookup", params)], tool_choice="required")
        self._send(http, "huge_enum", "POST", "/v1/chat/completions", content=self._raw(body, self.max_request_bytes),
                   headers={"Content-Type": "application/json"})

    def _deep(self, http: httpx.Client) -> None:
        depth = DEPTHS[next(self._serial) % len(DEPTHS)]
        body = json.dumps(self._chat("Fill the form.", tools=[tool("form", {})], tool_choice="required"))
        body = body.replace('"parameters": {}', '"parameters": ' + nested_schema(depth))
        self._send(http, f"deep_{depth}", "POST", "/v1/chat/completions", content=body.encode(),
                   headers={"Content-Type": "application/json"})

    def _churn(self, http: httpx.Client) -> None:
        name = f"churn-{next(self._serial)}"
        r = self._send(http, "churn", "POST", "/v1/chat/completions", json=self._chat("Open a ticket.", session_id=name))
        if r is not None and r.status_code == 200:
            self._send(http, "churn", "DELETE", f"/v1/sessions/{name}")

    def _pin(self, http: httpx.Client) -> None:
        name = f"pin-{next(self._serial) % 6}"
        r = self._send(http, "pin", "POST", "/v1/chat/completions", json=self._chat(LONG + name, session_id=name))
        if r is not None and r.status_code == 200:
            self._send(http, "pin", "POST", f"/v1/sessions/{name}/retain", json={"seconds": self.retain_s})

    def _flood(self, http: httpx.Client) -> None:
        """New sessions until the quota answers, then every one of them deleted (churn at the quota)."""
        made = []
        for _ in range(64):
            r = self._send(http, "flood", "POST", "/v1/sessions", json={})
            if r is None or r.status_code != 200 or self._stop.is_set():
                break
            made.append(r.json()["id"])
        for session_id in made:
            self._send(http, "flood", "DELETE", f"/v1/sessions/{session_id}")

    def _salt(self, http: httpx.Client) -> None:
        self._send(http, "salt", "POST", "/v1/chat/completions",
                   json=self._chat(LONG, cache_salt=f"s{next(self._serial)}"))

    def _malformed(self, http: httpx.Client) -> None:
        self._send(http, "malformed", "POST", "/v1/chat/completions", content=b'{"model": "x", "messages": [',
                   headers={"Content-Type": "application/json"})
        self._send(http, "malformed", "POST", "/v1/chat/completions", json={**self._chat("hi"), "max_tokens": "many"})
        self._send(http, "malformed", "POST", "/v1/chat/completions", json={**self._chat("hi"), "nonsense": True})
        self._send(http, "malformed", "POST", "/v1/sessions/../../etc/retain", json={"seconds": 1})
