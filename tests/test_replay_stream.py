"""A replay sends every system the identical request stream: two servers
that record what they receive (one addressed as our stateful systems are,
by session header, one as vLLM is, without) get the same bodies, in the
same order per agent, whatever their replies; the client's digests are
those of what arrived. Also: the trace format's checks and the tool
pauses' fit to their published statistic."""
from __future__ import annotations

import json
import math
import statistics

import pytest
from fastapi import FastAPI, Request

from agentkv.experiments.drivers.servers import AppThread
from agentkv.experiments.workloads.agent_runs import run_all
from agentkv.experiments.workloads.replay_agents import (PAUSE_MEDIAN_S, PAUSE_P90_S, PAUSE_P99_S, Sent, TracePauses,
                                                         openai_send, replay_job)
from agentkv.experiments.workloads.traces import Trace, body_digest, stream_digest

TOOLS = ({"type": "function", "function": {"name": "ls", "description": "list", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}},)


def trace(agent: str, turns: int) -> Trace:
    messages: list[dict] = [{"role": "system", "content": "You manage files."}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"{agent}: list folder {t}"})
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{t}", "type": "function", "function": {"name": "ls", "arguments": json.dumps({"path": str(t)})}}]})
        messages.append({"role": "tool", "content": f"file_{t}.txt " * (t + 1), "tool_call_id": f"c{t}"})
        messages.append({"role": "assistant", "content": f"Done {t}."})
    return Trace(agent, "test", "files", TOOLS, tuple(messages))


class Recorder:
    """An OpenAI-shaped chat server on 127.0.0.1 that records each body it
    receives and answers with a reply of its own (`style`)."""

    def __init__(self, style: str):
        self.bodies: list[tuple[str | None, dict]] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> dict:
            body = await request.json()
            self.bodies.append((request.headers.get("x-session-id"), body))
            text = f"{style} says {len(self.bodies)}"
            return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "length",
                                 "message": {"role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": body["max_tokens"], "total_tokens": 10}}

        self.server = AppThread(app)
        self.url = self.server.base_url

    def stop(self) -> None:
        self.server.stop()


def replay(traces: list[Trace], url: str, sessions: bool, model: str) -> Sent:
    sent = Sent()
    send = openai_send(url, sessions, "run")
    pauses = TracePauses(seed=0, scale=0.001)
    run_all({t.agent: replay_job(t, send, 7, pauses, model, sent) for t in traces})
    return sent


def test_every_system_receives_the_same_stream():
    traces = [trace("a", 3), trace("b", 2)]
    servers = {"stateful": Recorder("stateful"), "peer": Recorder("peer")}
    try:
        sent = {name: replay(traces, s.url, name == "stateful", f"model-{name}") for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    received = {}
    for name, s in servers.items():
        per_agent: dict[str, list[str]] = {}
        for header, body in s.bodies:
            agent = body["messages"][1]["content"].split(":")[0]
            per_agent.setdefault(agent, []).append(body_digest(body))
            assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["max_tokens"] == 7
            assert header == (f"run-{agent}" if name == "stateful" else None)
        received[name] = per_agent
    # What arrived is what the client says it sent, and the same on both servers.
    assert received["stateful"] == sent["stateful"].digests == sent["peer"].digests == received["peer"]
    assert stream_digest(sent["stateful"].digests) == stream_digest(sent["peer"].digests)
    assert [len(v) for _, v in sorted(received["peer"].items())] == [6, 4]
    # Each request is the history before its recorded reply: never a server's own reply.
    for _, body in servers["peer"].bodies:
        assert all("says" not in (m.get("content") or "") for m in body["messages"])


def test_the_digest_sees_any_change_but_the_model_name():
    t = trace("a", 1)
    body = {"model": "x", "messages": t.history(1), "tools": list(t.tools), "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True}
    assert body_digest(body) == body_digest({**body, "model": "y"})
    assert body_digest(body) != body_digest({**body, "max_tokens": 9})
    edited = json.loads(json.dumps(body))
    edited["messages"][-1]["content"] += " "
    assert body_digest(body) != body_digest(edited)


def test_a_trace_is_replayed_request_by_request():
    t = trace("a", 2)
    assert len(t) == 4 and t.replies == [2, 4, 6, 8]
    assert t.history(1)[-1]["role"] == "tool" and t.called_tools(0) == ["ls"] and t.called_tools(1) == []
    with pytest.raises(ValueError, match="no assistant"):
        Trace("x", "f", "g", (), ({"role": "user", "content": "hi"},))
    with pytest.raises(ValueError, match="begins with"):
        Trace("x", "f", "g", (), ({"role": "assistant", "content": "hi"},))


def test_pauses_follow_the_published_median_and_p90_clipped_at_p99():
    pauses = TracePauses(seed=3)
    draws = [pauses.draw(f"a{i}", 0, ["ls"]) for i in range(20_000)]
    q = statistics.quantiles(draws, n=100)
    assert math.isclose(statistics.median(draws), PAUSE_MEDIAN_S, rel_tol=0.1)
    assert math.isclose(q[89], PAUSE_P90_S, rel_tol=0.15)
    assert max(draws) == PAUSE_P99_S  # the tail is clipped at the published p99
    assert pauses.draw("a0", 0, []) == 0.0
    # Seeded: the same agent and request get the same pause, parallel calls the longest of theirs.
    assert pauses.draw("a1", 2, ["ls"]) == TracePauses(seed=3).draw("a1", 2, ["ls"])
    assert pauses.draw("a1", 2, ["ls", "cat"]) >= pauses.draw("a1", 2, ["ls"])
    assert TracePauses(seed=3, scale=0.5).draw("a1", 2, ["ls"]) == 0.5 * pauses.draw("a1", 2, ["ls"])
