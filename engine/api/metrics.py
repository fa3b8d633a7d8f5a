"""Prometheus metrics, written in the text exposition format by hand (a few
dozen series do not need a client library).

Token counters are the scheduler's running totals of its per-turn stats: the
engine's own accounting, counting every turn whichever endpoint or session
it came from. What vLLM's operators and routers read is also exported under
vLLM's names (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
`vllm:prefix_cache_hits_total`, ...) with its `model_name` label, so that
tooling written for vLLM reads this server too.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentkv.engine import EngineMetrics, Histogram

if TYPE_CHECKING:
    from agentkv.engine import Engine
    from agentkv.engine.api.sessions import SessionRegistry

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# TurnStats field -> (metric name, help)
TOKEN_COUNTERS = {
    "prompt_tokens": ("agentkv_prompt_tokens_total", "Prompt tokens of finished turns."),
    "reused_tokens": ("agentkv_cached_tokens_total", "Prompt tokens whose KV was reused, not computed."),
    "computed_tokens": ("agentkv_computed_tokens_total", "Tokens whose KV was computed by prefill."),
    "restored_tokens": ("agentkv_kv_restored_tokens_total", "Prompt tokens whose KV came back from the second tier."),
    "generated_tokens": ("agentkv_generated_tokens_total", "Tokens generated."),
    "drafted_tokens": ("agentkv_spec_drafted_tokens_total", "Speculative draft tokens verified."),
    "accepted_tokens": ("agentkv_spec_accepted_tokens_total", "Speculative draft tokens accepted."),
    "native_turns": ("agentkv_native_turns_total",
                     "Chat turns continued natively: the session's message log matched, only new messages computed."),
}


class Metrics:
    def __init__(self, engine: "Engine", sessions: "SessionRegistry", model_name: str):
        self.engine = engine
        self.sessions = sessions
        self.model_label = '{model_name="%s"}' % model_name.replace("\\", "\\\\").replace('"', '\\"')
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, int]] = Counter()
        self._latency = Histogram(LATENCY_BUCKETS)

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self._requests[endpoint, status] += 1

    def observe_turn(self, seconds: float) -> None:
        """Wall-clock time of one generation request, queueing included."""
        with self._lock:
            self._latency.observe(seconds)

    def render(self) -> str:
        e = self.engine.metrics()
        totals = e.turn_totals
        with self._lock:
            out = _family("agentkv_requests_total", "counter", "HTTP requests by endpoint and status.")
            out += [f'agentkv_requests_total{{endpoint="{k}",status="{s}"}} {n}' for (k, s), n in sorted(self._requests.items())]
            for field, (name, help_text) in TOKEN_COUNTERS.items():
                out += _family(name, "counter", help_text) + [f"{name} {int(totals.get(field, 0))}"]
            out += _gauge("agentkv_kv_pages_free", "KV cache pages free.", e.pages_free)
            out += _gauge("agentkv_kv_pages_used", "KV cache pages referenced.", e.pages_used)
            out += _gauge("agentkv_kv_pages_total", "KV cache pages in the pool.", e.pages_total)
            out += _gauge("agentkv_kv_pages_pinned", "KV cache pages held by sessions.", e.pages_pinned)
            out += _gauge("agentkv_prefix_cache_pages", "KV cache pages held by the prefix cache.", e.prefix_cache_pages)
            out += _gauge("agentkv_active_requests", "Requests queued or running.", e.in_flight)
            out += _gauge("agentkv_sessions", "Named sessions held by the server.", len(self.sessions))
            out += _gauge("agentkv_busy_sessions", "Named sessions with a request in flight.", self.sessions.busy_count())
            out += _histogram("agentkv_turn_latency_seconds", "Wall-clock latency of a generation request (one turn).",
                              "", self._latency)
        out += self._scheduler_lines(e)
        return "\n".join(out) + "\n"

    def _scheduler_lines(self, e: EngineMetrics) -> list[str]:
        m, c, totals = self.model_label, e.counters, e.turn_totals
        out = _labelled("vllm:num_requests_running", "gauge", "Requests in model execution batches.", m, e.running)
        out += _labelled("vllm:num_requests_waiting", "gauge", "Requests waiting to be processed.", m, e.waiting)
        out += _labelled("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", m,
                         e.pages_used / e.pages_total)
        # Read by the inference gateway's prefix-cache scorer (llm-d) for the KV block size.
        out += _labelled("vllm:cache_config_info", "gauge", "Information of the KV cache config.",
                         m[:-1] + f',block_size="{e.page_size}",num_gpu_blocks="{e.pages_total}"}}', 1)
        out += _labelled("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions.", m, c.preemptions)
        out += _labelled("agentkv_repeat_preemptions_total", "counter",
                         "Preemptions of a request preempted before.", "", c.repeat_preemptions)
        out += _family("agentkv_programs", "gauge",
                       "Agent programs (a session's turns) by admission state: admitted, queued, parked.")
        out += [f'agentkv_programs{{state="{state}"}} {n}' for state, n in e.programs.items()]
        out += _labelled("agentkv_admission_refusals_total", "counter",
                         "Times a step left a request waiting for its program's admission.", "", e.admission_refusals)
        out += _labelled("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in queried tokens.", m,
                         c.prefix_queries)
        out += _labelled("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in cached tokens.", m,
                         c.prefix_hits)
        out += _labelled("vllm:prompt_tokens_total", "counter", "Prefill tokens processed.", m,
                         int(totals.get("prompt_tokens", 0)))
        out += _labelled("vllm:generation_tokens_total", "counter", "Generation tokens processed.", m,
                         int(totals.get("generated_tokens", 0)))
        out += _histogram("vllm:request_queue_time_seconds", "Time spent waiting in the queue.", m, c.queue_s)
        out += _histogram("agentkv_step_batch_size", "Requests per scheduler step.", "", c.batch_size)
        out += _labelled("agentkv_steps_total", "counter", "Scheduler steps that ran work.", "", c.steps)
        out += _labelled("agentkv_prepositioned_tokens_total", "counter",
                         "Tokens computed ahead of a turn while the scheduler was idle.", "", c.prepositioned_tokens)
        out += _labelled("agentkv_requests_cancelled_total", "counter", "Requests cancelled (client gone).", "", c.cancelled)
        out += _labelled("agentkv_requests_finished_total", "counter", "Engine requests that finished.", "", c.finished)
        out += _labelled("agentkv_requests_failed_total", "counter", "Engine requests that failed (rolled back).", "", c.failed)
        out += _labelled("agentkv_step_seconds_total", "counter", "Wall time of steps that ran work.", "", c.step_s)
        out += _labelled("agentkv_forward_seconds_total", "counter", "Of that, time in the model's forward.", "", c.forward_s)
        for cause, seconds in c.stalled_s.items():
            out += _labelled(f"agentkv_stalled_{cause}_seconds_total", "counter",
                             f"Seconds the scheduler idled while requests waited ({cause}).", "", seconds)
        return out + self._tier_lines(e)

    def _tier_lines(self, e: EngineMetrics) -> list[str]:
        c = e.tier
        if c is None:
            return []
        out = []
        for name, value, help_text in (
            ("agentkv_kv_offloads_total", c.offloads, "Sequences whose KV moved to the second tier."),
            ("agentkv_kv_offload_bytes_total", c.offload_bytes, "Bytes of KV copied to the second tier."),
            ("agentkv_kv_offload_seconds_total", c.offload_s, "Time spent copying KV to the second tier."),
            ("agentkv_kv_restores_total", c.restores, "Restores of KV from the second tier."),
            ("agentkv_kv_restore_bytes_total", c.restore_bytes, "Bytes of KV copied back from the second tier."),
            ("agentkv_kv_restore_seconds_total", c.restore_s, "Time spent restoring KV from the second tier."),
            ("agentkv_kv_spilled_bytes_total", c.spilled_bytes, "Bytes of KV written to the disk tier."),
            ("agentkv_kv_disk_read_bytes_total", c.disk_read_bytes, "Bytes of KV read back from the disk tier."),
            ("agentkv_kv_tier_refused_total", c.refused, "Offloads the second tier had no room for."),
            ("agentkv_kv_tier_dropped_total", c.dropped, "Second-tier entries given up for room."),
            ("agentkv_kv_tier_corrupt_total", c.corrupt, "Second-tier entries that failed verification."),
            ("agentkv_kv_tier_disk_errors_total", c.disk_errors, "Writes to the disk tier that failed."),
        ):
            out += _labelled(name, "counter", help_text, "", value)
        out += _gauge("agentkv_kv_tier_host_bytes", "Bytes of KV held in host memory.", e.tier_host_bytes)
        out += _gauge("agentkv_kv_tier_disk_bytes", "Bytes of KV held on disk.", e.tier_disk_bytes)
        return out


def _family(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _labelled(name: str, kind: str, help_text: str, labels: str, value: float) -> list[str]:
    return _family(name, kind, help_text) + [f"{name}{labels} {value}"]


def _histogram(name: str, help_text: str, labels: str, h: Histogram) -> list[str]:
    inner = labels[1:-1] + "," if labels else ""
    out = _family(name, "histogram", help_text)
    out += [f'{name}_bucket{{{inner}le="{bound}"}} {n}' for bound, n in h.cumulative()]
    out.append(f'{name}_bucket{{{inner}le="+Inf"}} {h.total}')
    return out + [f"{name}_sum{labels} {h.sum}", f"{name}_count{labels} {h.total}"]


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
