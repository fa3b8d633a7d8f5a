"""This engine over HTTP, through the openai client: the Responses API
with previous_response_id (each turn sends only its new items) and chat
completions re-sending the whole history. Each serves WireTurns: warm_up(t)
once, then turn(t, messages) with the chat side's whole conversation; a
turn's row says the request bytes the client sent."""
from __future__ import annotations

import time

import httpx
import openai

from agentkv.experiments.drivers.system import WireTurn


class Wire:
    """The openai client over an httpx client (a TestClient for the app in
    process, or a plain one for a server), counting the request bytes sent."""

    def __init__(self, http: httpx.Client, model: str, base_url: str = "http://testserver/v1"):
        self.sent, self.model = 0, model
        http.event_hooks["request"].append(self._count)
        self.client = openai.OpenAI(base_url=base_url, api_key="bench", http_client=http, max_retries=0)

    def _count(self, request: httpx.Request) -> None:
        self.sent += len(request.content)

    def call(self, fn, **kwargs) -> tuple[object, float, int]:
        """fn(**kwargs): (its result, seconds, bytes sent)."""
        before, start = self.sent, time.perf_counter()
        out = fn(**kwargs)
        return out, time.perf_counter() - start, self.sent - before


def flat_tool(tool: dict) -> dict:
    """A chat completions tool in the Responses API's flat shape."""
    return {"type": "function", **tool["function"]}


def reply_of(r) -> dict:
    """A response's output as the assistant message of the chat side."""
    text = "".join(p.text for o in r.output if o.type == "message" for p in o.content) or None
    calls = [{"id": o.call_id, "type": "function", "function": {"name": o.name, "arguments": o.arguments}}
             for o in r.output if o.type == "function_call"]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


class ResponsesSystem:
    """Each agent's turn continues its previous response. engine: the one
    behind the app, whose last turn's stats say what was computed."""

    name = "responses"

    def __init__(self, wire: Wire, engine):
        self.wire, self.engine, self.last = wire, engine, {}

    def warm_up(self, t: WireTurn) -> None:
        self.wire.client.responses.create(model=self.wire.model, input="warm up",
                                          tools=[flat_tool(x) for x in t.tools], max_output_tokens=4, store=False)

    def turn(self, t: WireTurn, messages: list[dict]) -> dict:
        agent = t.request.agent
        r, latency, sent = self.wire.call(
            self.wire.client.responses.create, model=self.wire.model, input=t.items,
            tools=[flat_tool(x) for x in t.tools], previous_response_id=self.last.get(agent), temperature=0.0,
            max_output_tokens=t.request.gen, extra_body={"ignore_eos": True},
        )
        self.last[agent] = r.id
        u = r.usage
        return {"latency_s": latency, "bytes": sent, "prompt": u.input_tokens, "cached": u.input_tokens_details.cached_tokens,
                "computed": self.engine.stats[-1].computed_tokens, "generated": u.output_tokens,
                "reply": reply_of(r)}


class ChatSystem:
    """Each turn re-sends the agent's whole conversation."""

    name = "chat"

    def __init__(self, wire: Wire, engine):
        self.wire, self.engine = wire, engine

    def warm_up(self, t: WireTurn) -> None:
        self.wire.client.chat.completions.create(model=self.wire.model,
                                                 messages=[{"role": "user", "content": "warm up"}],
                                                 tools=t.tools, max_tokens=4)

    def turn(self, t: WireTurn, messages: list[dict]) -> dict:
        c, latency, sent = self.wire.call(
            self.wire.client.chat.completions.create, model=self.wire.model, messages=messages, tools=t.tools,
            temperature=0.0, max_tokens=t.request.gen, extra_body={"ignore_eos": True},
        )
        m, u = c.choices[0].message, c.usage
        calls = [{"id": x.id, "type": "function", "function": {"name": x.function.name, "arguments": x.function.arguments}}
                 for x in m.tool_calls or []]
        return {"latency_s": latency, "bytes": sent, "prompt": u.prompt_tokens, "cached": u.prompt_tokens_details.cached_tokens,
                "computed": self.engine.stats[-1].computed_tokens, "generated": u.completion_tokens,
                "reply": {"role": "assistant", "content": m.content, **({"tool_calls": calls} if calls else {})}}
