"""The public port of `serve.py cluster`: a reverse proxy that passes the
client API to vllm-router and nothing else.

vllm-router serves its worker management (POST /add_worker and
/remove_worker, GET /list_workers, /workers and /workers/{url}, /get_loads,
POST /flush_cache, /finish_session, ...) on the port it routes requests on,
with no authentication and no option to serve it elsewhere: on a public port
anyone could take the replicas out of the ring, or add a worker of their own
and receive other tenants' requests. So the router listens on loopback only
(engine.api.cluster) and this proxy takes the public --host:--port. It
forwards only the paths the replicas serve to clients (PUBLIC_PATHS, those
of engine.api.app) and answers any other with the replicas' own 404 body, so
an admin path looks like any unknown one.

What passes goes through as it came: method, path and query as the client
wrote them, every header but the hop-by-hop ones (Authorization and
X-Session-Id included: the replicas check API keys, the router hashes
sessions), the body streamed both ways, the router's status and headers
intact. A response is relayed chunk by chunk as the router sends it, so
server-sent events arrive token by token; a client that goes away closes its
connection to the router, as if it had been connected to it directly.

The proxy runs in a thread of the cluster's process (RouterProxy), which has
imported all of this already: a process of its own would import the engine's
API again only to serve a 404 body.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.parse
from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from agentkv.engine.api.errors import APIError, not_found

log = logging.getLogger("agentkv.cluster.proxy")

# What engine.api.app serves to clients (each path and everything under it); a route added there that clients
# should reach through a cluster is added here too. The router forwards these to a replica.
PUBLIC_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/sessions",
                "/health", "/metrics")
# RFC 9110 7.6.1: meant for one connection, not forwarded (those a Connection header names neither).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade"})
CONNECT_TIMEOUT_S = 5.0


class ProxyError(RuntimeError):
    pass


class ProxyStartError(ProxyError):
    pass


def is_public(path: str) -> bool:
    """Whether a request's path (percent-decoded) is forwarded to the router.
    A dot segment is never forwarded: /v1/sessions/../remove_worker would be
    an admin path to whatever resolves it after this check."""
    if any(segment in (".", "..") for segment in path.split("/")):
        return False
    return any(path == p or path.startswith(p + "/") for p in PUBLIC_PATHS)


def _forwarded(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Headers without the hop-by-hop ones, duplicates and order kept."""
    named = {token.strip().lower() for name, value in raw if name.lower() == b"connection"
             for token in value.decode("latin-1").split(",")}
    return [(name, value) for name, value in raw
            if (n := name.decode("latin-1").lower()) not in HOP_BY_HOP and n not in named]


def create_app(router_url: str) -> Starlette:
    """The proxy's ASGI app, forwarding PUBLIC_PATHS to router_url (http://host:port)."""
    forward = _Forward(router_url)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with forward:
            yield

    # An ASGI endpoint rather than a function: a route of any method, so that every path outside the API is a 404.
    return Starlette(routes=[Route("/{path:path}", forward)], lifespan=lifespan,
                     exception_handlers={Exception: _internal_error})


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("proxy error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error").response()


class _Forward:
    """Each request's path checked, then sent to the router with the client's headers and body stream."""

    def __init__(self, router_url: str):
        self.router_url = router_url
        self.client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> "_Forward":
        # No read or write timeout: a long prefill or a slow client is the router's and the replica's to bound.
        # trust_env=False: an HTTP_PROXY in the environment must not carry loopback traffic elsewhere.
        self.client = httpx.AsyncClient(base_url=self.router_url, trust_env=False,
                                        timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        for name in ("accept", "accept-encoding", "user-agent"):  # httpx's defaults: only the client's pass
            del self.client.headers[name]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        response = await self._response(request)
        await response(scope, receive, send)

    async def _response(self, request: Request) -> Response:
        raw_path: bytes = request.scope.get("raw_path") or request.scope["path"].encode()
        if not is_public(urllib.parse.unquote(raw_path.decode("latin-1"))):
            # The replicas' own body for an unknown path: an admin path looks like any other.
            return not_found("Not Found", "not_found").response()
        if self.client is None:
            raise ProxyError("the proxy's client is not open: the app's lifespan did not run")
        target = raw_path.decode("latin-1")  # as the client wrote it, percent-encoding and all
        if query := request.scope.get("query_string"):
            target += "?" + query.decode("latin-1")
        headers = [(n, v) for n, v in _forwarded(request.headers.raw) if n.lower() != b"host"]
        has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
        upstream_request = self.client.build_request(request.method, target, headers=headers,
                                                     content=request.stream() if has_body else None)
        try:
            upstream = await self.client.send(upstream_request, stream=True)
        except httpx.TransportError as e:
            log.warning("the router at %s did not answer %s %s: %r", self.router_url, request.method, target, e)
            return APIError(502, f"the router did not answer: {type(e).__name__}", type="server_error",
                            code="router_unavailable").response()
        return _Relay(upstream)


class _Relay(StreamingResponse):
    """The router's response as it arrives: status, headers (duplicates too) and raw body bytes (any
    content-encoding stays the client's to undo). The connection to the router is closed however the
    relay ends, so a client that went away cancels its request upstream."""

    def __init__(self, upstream: httpx.Response):
        super().__init__(self._body(upstream), status_code=upstream.status_code,
                         background=BackgroundTask(upstream.aclose))
        self.raw_headers = _forwarded(upstream.headers.raw)
        self._upstream = upstream

    @staticmethod
    async def _body(upstream: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError as e:
            # Mid-response: the status is sent, so the only honest signal left is the aborted connection.
            log.warning("the router's response broke off: %r", e)
            raise

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._upstream.aclose()  # idempotent; the background task misses a disconnect on ASGI 2.4


class RouterProxy:
    """create_app served by uvicorn on host:port in a thread of this process."""

    def __init__(self, router_url: str, host: str, port: int, *, graceful_timeout: float = 8.0):
        self.router_url, self.host, self.port = router_url, host, port
        self.graceful_timeout = graceful_timeout
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> "RouterProxy":
        """Returns once the port accepts connections; ProxyStartError if it cannot be had."""
        if self._thread is not None:
            raise ProxyError("this proxy was already started")
        # Bound here, not by uvicorn, which would log a busy port and end its thread: the caller gets the error.
        sock = _listen(self.host, self.port)
        # log_config=None: the process's logging (the cluster's, a test's) stays as it was configured.
        config = uvicorn.Config(create_app(self.router_url), lifespan="on", log_level="warning", log_config=None,
                                access_log=False,
                                # The router's (the replica's) Server and Date headers pass through instead.
                                server_header=False, date_header=False,
                                timeout_graceful_shutdown=self.graceful_timeout)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, args=(sock,), name="agentkv-router-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise ProxyStartError(f"the proxy on {self.host}:{self.port} stopped while starting (see the log)")
            if time.monotonic() > deadline:
                self.stop(1.0)
                raise ProxyStartError(f"the proxy on {self.host}:{self.port} did not start within {timeout:.0f} s")
            time.sleep(0.02)
        return self

    def _serve(self, sock: socket.socket) -> None:
        assert self._server is not None
        try:
            # Its own event loop: uvicorn installs no signal handlers off the main thread, the cluster handles them.
            self._server.run(sockets=[sock])
        except BaseException:
            log.exception("the proxy on %s:%d failed", self.host, self.port)
        finally:
            sock.close()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float) -> None:
        """Stop accepting connections, give requests in flight graceful_timeout to end, then cut them;
        idempotent."""
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(2.0)
            if self._thread.is_alive():
                log.warning("the proxy on %s:%d did not stop within %.0f s", self.host, self.port, timeout)


def _listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ProxyStartError(f"cannot listen on {host}:{port}: {e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ProxyStartError(f"cannot listen on {host}:{port}: {e}") from e
    return sock
