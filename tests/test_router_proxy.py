"""The public port of a cluster (engine.api.router_proxy) against a stand-in
for vllm-router: only the client API passes, with its headers, body, status
and stream as they were; the router's admin paths (dot-segment tricks too)
are 404 and never reach it; an unreachable router is a 502 and a busy port
a clear error. The real router behind it: tests/test_replicas.py."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from typing import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentkv.engine.api.router_proxy import PUBLIC_PATHS, ProxyStartError, RouterProxy, is_public
from agentkv.experiments.drivers.servers import free_port


class Upstream:
    """A stand-in router on loopback that records what reaches it and echoes it back."""

    def __init__(self):
        self.seen: list[tuple[str, str]] = []
        self.release = threading.Event()  # the stream's second event waits for it
        self.port = free_port()
        app = Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET", "POST", "DELETE"])])
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_config=None, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, request: Request) -> Response:
        self.seen.append((request.method, request.scope["raw_path"].decode()))
        if request.url.path == "/v1/chat/completions/stream":
            async def events() -> Iterator[bytes]:
                yield b"data: first\n\n"
                await asyncio.to_thread(self.release.wait, 10)
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream", headers={"X-Request-Id": "r-1"})
        body = await request.body()
        echo = {"method": request.method, "path": request.url.path, "raw_path": request.scope["raw_path"].decode(),
                "query": request.url.query, "body": body.decode(), "headers": request.headers.items()}
        response = JSONResponse(echo, status_code=int(request.headers.get("x-status", 200)))
        response.raw_headers += [(b"set-cookie", b"a=1"), (b"set-cookie", b"b=2")]
        return response

    def __enter__(self) -> "Upstream":
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    with Upstream() as u:
        yield u


@pytest.fixture
def proxy(upstream) -> Iterator[str]:
    p = RouterProxy(upstream.url, "127.0.0.1", free_port()).start()
    try:
        yield f"http://127.0.0.1:{p.port}"
    finally:
        p.stop(10)
    assert not p.alive()


def raw_request(url: str, method: str, target: str) -> tuple[int, dict]:
    """A request target sent as written (httpx would resolve dot segments before sending)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, target)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


@pytest.mark.parametrize("path", [*PUBLIC_PATHS, "/v1/models/agentkv", "/v1/sessions/agent-1/fork",
                                  "/v1/responses/resp_1/input_items"])
def test_the_client_api_is_public(path):
    assert is_public(path)


@pytest.mark.parametrize("path", ["/", "", "/add_worker", "/remove_worker", "/list_workers", "/workers",
                                  "/workers/http://127.0.0.1:1", "/get_loads", "/flush_cache", "/finish_session",
                                  "/readiness", "/liveness", "/v1", "/v1/", "/v1/embeddings", "/v1/sessionsx",
                                  "/healthz", "/V1/models", "//remove_worker", "/v1/sessions/../remove_worker",
                                  "/v1/models/./x", "/health/..", "/v1/sessions/a/../../list_workers"])
def test_everything_else_is_not(path):
    assert not is_public(path)


ADMIN = [("POST", "/remove_worker?url=http%3A%2F%2F127.0.0.1%3A1"), ("POST", "/add_worker?url=http://127.0.0.1:9"),
         ("GET", "/list_workers"), ("GET", "/workers"), ("DELETE", "/workers/http%3A%2F%2F127.0.0.1%3A1"),
         ("GET", "/get_loads"), ("POST", "/flush_cache"), ("GET", "/"), ("PUT", "/v1/whatever"), ("TRACE", "/x")]


def test_admin_paths_are_404_and_never_reach_the_router(upstream, proxy):
    for method, path in ADMIN:
        r = httpx.request(method, proxy + path, timeout=30)
        assert r.status_code == 404, (method, path)
        assert r.json() == {"error": {"message": "Not Found", "type": "invalid_request_error", "param": None,
                                      "code": "not_found"}}
    for target in ("/v1/sessions/../remove_worker?url=x", "/v1/models/%2e%2E/list_workers",
                   "/v1/sessions/..%2Fremove_worker", "/v1/sessions/%2E/../workers", "/health/.."):
        status, body = raw_request(proxy, "POST", target)
        assert status == 404 and body["error"]["code"] == "not_found", target
    assert upstream.seen == []


def test_a_request_passes_as_it_came(upstream, proxy):
    headers = {"Authorization": "Bearer sk-1", "X-Session-Id": "agent-1", "X-Status": "401",
               "Content-Type": "application/json"}
    r = httpx.post(proxy + "/v1/sessions/agent%2F1/fork?a=1&b=%20", headers=headers, content=b'{"x": 1}',
                   timeout=30)
    assert r.status_code == 401  # the router's status, whatever it is
    echo = r.json()
    assert echo["method"] == "POST" and echo["raw_path"] == "/v1/sessions/agent%2F1/fork"
    assert echo["query"] == "a=1&b=%20" and echo["body"] == '{"x": 1}'
    sent = dict(echo["headers"])
    assert sent["authorization"] == "Bearer sk-1" and sent["x-session-id"] == "agent-1"
    assert sent["content-type"] == "application/json" and sent["content-length"] == "8"
    assert "user-agent" in sent and "accept-encoding" in sent  # httpx's own, which the client sent
    assert r.headers.get_list("set-cookie") == ["a=1", "b=2"]  # duplicates kept
    assert r.headers.get_list("server") == ["uvicorn"]  # the router's, not a second one of the proxy's
    # A bodiless GET stays bodiless; a chunked upload is streamed through.
    assert httpx.get(proxy + "/v1/models", timeout=30).json()["body"] == ""
    r = httpx.post(proxy + "/v1/completions", content=iter([b'{"a":', b' 2}']), timeout=30)
    assert r.json()["body"] == '{"a": 2}'
    assert upstream.seen == [("POST", "/v1/sessions/agent%2F1/fork"), ("GET", "/v1/models"),
                             ("POST", "/v1/completions")]


def test_a_stream_passes_event_by_event(upstream, proxy):
    """The first event arrives while the router still holds the second back: nothing is buffered."""
    with httpx.stream("POST", proxy + "/v1/chat/completions/stream", json={}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"] == "r-1" and "content-length" not in r.headers
        lines = r.iter_lines()
        assert next(lines) == "data: first"
        upstream.release.set()
        assert [line for line in lines if line] == ["data: [DONE]"]


def test_an_unreachable_router_is_a_502():
    p = RouterProxy(f"http://127.0.0.1:{free_port()}", "127.0.0.1", free_port()).start()
    try:
        r = httpx.get(f"http://127.0.0.1:{p.port}/health", timeout=30)
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "router_unavailable"
    finally:
        p.stop(10)


def test_a_busy_port_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ProxyStartError, match=f"cannot listen on 127.0.0.1:{port}"):
            RouterProxy("http://127.0.0.1:1", "127.0.0.1", port).start()
