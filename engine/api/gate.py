"""The gate every request passes before a route sees it (ASGI middleware):
it authenticates the API key (401 if missing or unknown, on every path but
the public ones), bounds the tenant's requests in flight (429 with
Retry-After) and the request body's size (413), and leaves the tenant in
the request's state for the routes (engine.api.tenants.tenant_of).

The body is read here, up to the limit, before the route runs: a client
that sends more is refused without the server holding more than the limit,
and nothing downstream has seen the request.
"""
from __future__ import annotations

import threading
from collections import Counter

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentkv.engine.api.errors import APIError
from agentkv.engine.api.quotas import Quotas
from agentkv.engine.api.tenants import ApiKeys


class Gate:
    def __init__(self, app: ASGIApp, keys: ApiKeys, quotas: Quotas, public_paths: frozenset[str]):
        self.app, self.keys, self.quotas, self.public_paths = app, keys, quotas, public_paths
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()

    def in_flight(self, tenant: str) -> int:
        with self._lock:
            return self._in_flight[tenant]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public_paths:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        tenant = self.keys.authenticate(headers.get("authorization"))
        if tenant is None:
            await _answer(scope, receive, send, APIError(
                401, "a valid API key is required: send it as `Authorization: Bearer KEY`",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            return
        # Only between tenants: an open server's one tenant is bounded by the server's queue.
        limit = self.quotas.max_concurrent if not self.keys.open else None
        with self._lock:
            busy = limit is not None and self._in_flight[tenant.name] >= limit
            if not busy:
                self._in_flight[tenant.name] += 1
        if busy:
            await _answer(scope, receive, send, APIError(
                429, f"this tenant already has {limit} requests in flight, its quota; retry when one has finished",
                type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"}))
            return
        try:
            body = await self._read_body(headers, receive)
            if body is None:
                await _answer(scope, receive, send, APIError(
                    413, f"the request body exceeds {self.quotas.max_body_bytes} bytes", code="request_too_large"))
                return
            scope.setdefault("state", {})["tenant"] = tenant
            await self.app(scope, _replay(body, receive), send)
        finally:
            with self._lock:
                self._in_flight[tenant.name] -= 1
                if not self._in_flight[tenant.name]:
                    del self._in_flight[tenant.name]

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> list[Message] | None:
        """The body's messages, or None if it is larger than the limit."""
        limit = self.quotas.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return None
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away: the route sees that
                return messages
            size += len(message.get("body", b""))
            if size > limit:
                return None
            if not message.get("more_body", False):
                return messages


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """The body as read, then the client's later messages (a disconnect)."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


async def _answer(scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
    await error.response()(scope, receive, send)
