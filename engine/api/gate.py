"""The gate every request passes before a route sees it (ASGI middleware):
it authenticates the API key (401 if missing or unknown, on every path but
the public ones; `Authorization: Bearer KEY` or, as Anthropic's clients
send it, `x-api-key: KEY`), bounds the tenant's requests in flight (429 with
Retry-After) and the request body's size (413), and leaves the tenant in
the request's state for the routes (engine.api.tenants.tenant_of).

The body is read here, up to the limit, before the route runs: a client
that sends more is refused without the server holding more than the limit,
and nothing downstream has seen the request.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentkv.engine.api.errors import APIError
from agentkv.engine.api.quotas import Quotas
from agentkv.engine.api.tenants import ApiKeys

# A refusal's response, given the path it refuses: each API answers in its own shape.
Answer = Callable[[str, APIError], Response]


def _openai_answer(path: str, error: APIError) -> Response:
    return error.response()


class Gate:
    def __init__(self, app: ASGIApp, keys: ApiKeys, quotas: Quotas, public_paths: frozenset[str],
                 answer: Answer = _openai_answer):
        self.app, self.keys, self.quotas, self.public_paths = app, keys, quotas, public_paths
        self.answer = answer
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
        tenant = self.keys.authenticate(_authorization(headers))
        if tenant is None:
            await self._answer(scope, receive, send, APIError(
                401, "a valid API key is required: send it as `Authorization: Bearer KEY` or `x-api-key: KEY`",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            return
        # Only between tenants: an open server's one tenant is bounded by the server's queue.
        limit = self.quotas.max_concurrent if not self.keys.open else None
        with self._lock:
            busy = limit is not None and self._in_flight[tenant.name] >= limit
            if not busy:
                self._in_flight[tenant.name] += 1
        if busy:
            await self._answer(scope, receive, send, APIError(
                429, f"this tenant already has {limit} requests in flight, its quota; retry when one has finished",
                type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"}))
            return
        try:
            body = await self._read_body(headers, receive)
            if body is None:
                await self._answer(scope, receive, send, APIError(
                    413, f"the request body exceeds {self.quotas.max_body_bytes} bytes", code="request_too_large"))
                return
            scope.setdefault("state", {})["tenant"] = tenant
            await self.app(scope, _replay(body, receive), send)
        finally:
            with self._lock:
                self._in_flight[tenant.name] -= 1
                if not self._in_flight[tenant.name]:
                    del self._in_flight[tenant.name]

    async def _answer(self, scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
        await self.answer(scope["path"], error)(scope, receive, send)

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


def _authorization(headers: dict[str, str]) -> str | None:
    """The Authorization header, or Anthropic's x-api-key as one."""
    if "authorization" in headers or "x-api-key" not in headers:
        return headers.get("authorization")
    return "Bearer " + headers["x-api-key"]
