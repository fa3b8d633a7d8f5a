"""Prometheus metrics, written in the text exposition format by hand (a dozen
series do not need a client library).

Token counters are folded in from the engine's per-turn stats at scrape time:
they are the engine's own accounting, and they count every turn whichever
endpoint or session it came from.
"""
from __future__ import annotations

import bisect
import threading
from collections import Counter
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from engine import Engine
    from engine.api.sessions import SessionRegistry

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# TurnStats field -> (metric name, help)
TOKEN_COUNTERS = {
    "prompt_tokens": ("agentkv_prompt_tokens_total", "Prompt tokens of finished turns."),
    "reused_tokens": ("agentkv_cached_tokens_total", "Prompt tokens whose KV was reused, not computed."),
    "computed_tokens": ("agentkv_computed_tokens_total", "Tokens whose KV was computed by prefill."),
    "generated_tokens": ("agentkv_generated_tokens_total", "Tokens generated."),
    "drafted_tokens": ("agentkv_spec_drafted_tokens_total", "Speculative draft tokens verified."),
    "accepted_tokens": ("agentkv_spec_accepted_tokens_total", "Speculative draft tokens accepted."),
}


class Metrics:
    def __init__(self, engine: "Engine", sessions: "SessionRegistry"):
        self.engine = engine
        self.sessions = sessions
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, int]] = Counter()
        self._tokens: Counter[str] = Counter()
        self._turns_seen = 0  # how many of engine.stats are folded into _tokens
        self._latency_buckets = [0] * len(LATENCY_BUCKETS)
        self._latency_sum = 0.0
        self._latency_count = 0

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self._requests[endpoint, status] += 1

    def observe_turn(self, seconds: float) -> None:
        """Wall-clock time of one generation request, queueing included."""
        with self._lock:
            i = bisect.bisect_left(LATENCY_BUCKETS, seconds)
            if i < len(LATENCY_BUCKETS):
                self._latency_buckets[i] += 1
            self._latency_sum += seconds
            self._latency_count += 1

    def _fold_turns(self) -> None:
        stats = self.engine.stats
        for turn in stats[self._turns_seen : len(stats)]:
            for field in TOKEN_COUNTERS:
                self._tokens[field] += getattr(turn, field)
            self._turns_seen += 1

    def render(self) -> str:
        pool = self.engine.pool
        with self._lock:
            self._fold_turns()
            out = _family("agentkv_requests_total", "counter", "HTTP requests by endpoint and status.")
            out += [f'agentkv_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self._requests.items())]
            for field, (name, help_text) in TOKEN_COUNTERS.items():
                out += _family(name, "counter", help_text) + [f"{name} {self._tokens[field]}"]
            out += _gauge("agentkv_kv_pages_free", "KV cache pages free.", pool.num_free)
            out += _gauge("agentkv_kv_pages_used", "KV cache pages referenced.", pool.num_used)
            out += _gauge("agentkv_kv_pages_total", "KV cache pages in the pool.", pool.num_pages)
            cache = self.engine.cache_stats()
            out += _gauge("agentkv_kv_pages_pinned", "KV cache pages held by sessions.", cache["pages_pinned"])
            out += _gauge("agentkv_prefix_cache_pages", "KV cache pages held by the prefix cache.", cache.get("cached_pages", 0))
            out += _gauge("agentkv_active_requests", "Requests the scheduler is running.", len(self.engine.scheduler.active))
            out += _gauge("agentkv_sessions", "Named sessions held by the server.", len(self.sessions))
            out += _gauge("agentkv_busy_sessions", "Named sessions with a request in flight.", self.sessions.busy_count())
            out += self._latency_lines()
        return "\n".join(out) + "\n"

    def _latency_lines(self) -> list[str]:
        name = "agentkv_turn_latency_seconds"
        out = _family(name, "histogram", "Wall-clock latency of a generation request (one turn).")
        cumulative = 0
        for bound, n in zip(LATENCY_BUCKETS, self._latency_buckets):
            cumulative += n
            out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self._latency_count}')
        out += [f"{name}_sum {self._latency_sum}", f"{name}_count {self._latency_count}"]
        return out


def _family(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _gauge(name: str, help_text: str, value: int) -> list[str]:
    return _family(name, "gauge", help_text) + [f"{name} {value}"]


class RequestCounter:
    """ASGI middleware counting responses by route template (not raw path,
    which would give every session id its own series) and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client gets if the app raises before answering

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope.get("route")
            self.metrics.count_request(getattr(route, "path", "unmatched"), status)
