"""Agent frameworks, unchanged, against the server over real HTTP on the
embedded default model: the OpenAI Agents SDK over chat completions and the
Responses API (a triage agent hands off to an agent with a function tool and
an output_type; Runner.run, then Runner.run_streamed going on from it), and
LangChain's ChatOpenAI over both (bind_tools, invoked and streamed;
with_structured_output by json_schema and by function calling), and the
README's snippets, Anthropic's SDK over /v1/messages among them.

A run passes when the framework raises nothing, every tool call it gets
parses and runs, call and response ids come back as the server gave them,
and on the Responses API every turn that goes on with the same agent reuses
the KV of the whole previous turn. The small model is told which tool to call
(tool_choice) rather than trusted to pick one."""
from __future__ import annotations

import asyncio
import json
import operator
import re
from functools import reduce
from pathlib import Path
from typing import Literal

import httpx
import pytest
from agents import (
    Agent,
    HandoffCallItem,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from agentkv import Engine
from agentkv.engine.api import create_app
from tests.conftest import assert_all_pages_free, http_server

pytestmark = pytest.mark.slow

MODEL = "agentkv-default"  # as serve.py names the embedded model, so that the README's snippets run as written
KEY = "framework-tests"
APIS = ["chat", "responses"]


class Report(BaseModel):
    # Bounded, so that the small model's reply ends well inside max_tokens.
    city: str = Field(max_length=12)
    sky: Literal["sunny", "cloudy", "rainy"]


def ask(city: str) -> str:
    return f'Next step: call get_weather with city="{city}".'


def weather(city: str) -> str:
    return json.dumps({"city": city, "sky": "sunny"})


class Wire:
    """The JSON bodies a framework sent, in order."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def record(self, request: httpx.Request) -> None:
        if request.method == "POST":
            self.bodies.append(json.loads(request.content))

    async def arecord(self, request: httpx.Request) -> None:
        self.record(request)

    def returned_call_ids(self) -> list[str]:
        """The call ids of the tool results sent back (chat tool messages, Responses function_call_outputs)."""
        return [m["tool_call_id"] if "tool_call_id" in m else m["call_id"]
                for body in self.bodies for m in body.get("messages", body.get("input", []))
                if isinstance(m, dict) and (m.get("role") == "tool" or m.get("type") == "function_call_output")]


@pytest.fixture(scope="module")
def server():
    set_tracing_disabled(True)  # the Agents SDK would export traces to OpenAI
    engine = Engine.from_pretrained(num_pages=1024)
    app = create_app(engine, MODEL)
    with http_server(app) as url:
        yield url
    assert_all_pages_free(engine)


# The OpenAI Agents SDK.


def triage_agent(model: OpenAIChatCompletionsModel | OpenAIResponsesModel, executed: list[str]) -> Agent:
    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        executed.append(city)
        return weather(city)

    # "required" on each agent's first turn; once a tool has run the SDK
    # resets it to "auto", where the output_type's grammar holds the reply to a Report.
    settings = ModelSettings(max_tokens=64, temperature=0.0, tool_choice="required")
    checker = Agent(name="weather", instructions="You check the weather.", tools=[get_weather], output_type=Report,
                    model=model, model_settings=settings)
    return Agent(name="triage", instructions="Hand weather questions to the weather agent.", handoffs=[checker],
                 model=model, model_settings=settings)


def kinds(items: list) -> list[str]:
    return [type(item).__name__ for item in items]


async def agents_runs(url: str, api: str) -> None:
    wire = Wire()
    async with httpx.AsyncClient(event_hooks={"request": [wire.arecord]}, timeout=60) as http:
        client = AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, http_client=http)
        kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        executed: list[str] = []
        chained = api == "responses"
        run = await Runner.run(triage_agent(kind(model=MODEL, openai_client=client), executed), ask("Paris"),
                               auto_previous_response_id=chained)
        assert kinds(run.new_items) == ["HandoffCallItem", "HandoffOutputItem", "ToolCallItem", "ToolCallOutputItem",
                                        "MessageOutputItem"]
        assert run.last_agent.name == "weather" and isinstance(run.final_output, Report)
        # Over chat the history is sent again; over Responses only the new question, after the last response.
        follow_up = [{"role": "user", "content": ask("Rome")}]
        streamed = Runner.run_streamed(run.last_agent, follow_up if chained else run.to_input_list() + follow_up,
                                       previous_response_id=run.last_response_id if chained else None,
                                       auto_previous_response_id=chained)
        events = [event async for event in streamed.stream_events()]
        assert streamed.is_complete and isinstance(streamed.final_output, Report)
        assert kinds(streamed.new_items) == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
        assert any(event.type == "raw_response_event" for event in events)

        items = run.new_items + streamed.new_items
        calls = [item.raw_item for item in items if isinstance(item, ToolCallItem)]
        results = {item.raw_item["call_id"]: item.output for item in items if isinstance(item, ToolCallOutputItem)}
        assert executed == [json.loads(call.arguments)["city"] for call in calls]
        assert [results[call.call_id] for call in calls] == [weather(city) for city in executed]
        given = [item.raw_item.call_id for item in items if isinstance(item, (HandoffCallItem, ToolCallItem))]
        returned = wire.returned_call_ids()
        # Over chat each request sends every earlier result again; over Responses each goes once.
        assert (returned if chained else list(dict.fromkeys(returned))) == given
        if chained:
            await check_chain(http, url, wire, run.raw_responses + streamed.raw_responses, given)


async def check_chain(http: httpx.AsyncClient, url: str, wire: Wire, responses: list, given: list[str]) -> None:
    """Each request goes on from the response before it with only its new items, the server
    holds each response with the calls the SDK ran, and each turn of the same agent as the
    one before reuses all of that turn's prompt (the handoff's turn renders other
    instructions and tools, as it would at OpenAI, so it cannot)."""
    ids = [r.response_id for r in responses]
    assert [body.get("previous_response_id") for body in wire.bodies] == [None] + ids[:-1]
    assert [[item.get("type", "message") for item in body["input"]] for body in wire.bodies] == [
        ["message"], ["function_call_output"], ["function_call_output"], ["message"], ["function_call_output"]]
    # Read back over HTTP (the server is open: one tenant, whatever the key).
    stored = [(await http.get(f"{url}/v1/responses/{i}", headers={"Authorization": f"Bearer {KEY}"})).json() for i in ids]
    assert [o["call_id"] for r in stored for o in r["output"] if o["type"] == "function_call"] == given
    for before, after in zip(responses[1:], responses[2:]):
        assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens


@pytest.mark.parametrize("api", APIS)
def test_agents_sdk_triage_handoff_tool_and_output_type(server, api):
    asyncio.run(agents_runs(server, api))


# LangChain.


def lang_model(url: str, api: str, http: httpx.Client) -> ChatOpenAI:
    responses = api == "responses"
    return ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key=KEY, temperature=0.0, max_tokens=48,
                      max_retries=0, http_client=http, use_responses_api=responses, use_previous_response_id=responses)


@pytest.mark.parametrize("api", APIS)
def test_langchain_bind_tools_invoke_and_stream(server, api):
    executed: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        executed.append(city)
        return weather(city)

    wire = Wire()
    with httpx.Client(event_hooks={"request": [wire.record]}, timeout=60) as http:
        bound = lang_model(server, api, http).bind_tools([get_weather], tool_choice="get_weather")
        first = bound.invoke([HumanMessage(ask("Paris"))])
        result = get_weather.invoke(first.tool_calls[0])
        second = reduce(operator.add, bound.stream([HumanMessage(ask("Paris")), first, result, HumanMessage(ask("Rome"))]))
    for reply in (first, second):
        assert not reply.invalid_tool_calls and len(reply.tool_calls) == 1
    calls = [first.tool_calls[0], second.tool_calls[0]]
    results = [result, get_weather.invoke(calls[1])]
    assert executed == [call["args"]["city"] for call in calls]
    assert [r.content for r in results] == [weather(city) for city in executed]
    assert [r.tool_call_id for r in results] == [call["id"] for call in calls]
    assert wire.returned_call_ids() == [calls[0]["id"]]
    if api == "responses":
        first_id = first.response_metadata["id"]
        assert wire.bodies[1]["previous_response_id"] == first_id
        assert [item.get("type", "message") for item in wire.bodies[1]["input"]] == ["function_call_output", "message"]
        cached = second.usage_metadata["input_token_details"]["cache_read"]
        assert cached >= first.usage_metadata["input_tokens"]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
@pytest.mark.parametrize("api", APIS)
def test_langchain_structured_output(server, api, method):
    wire = Wire()
    with httpx.Client(event_hooks={"request": [wire.record]}, timeout=60) as http:
        structured = lang_model(server, api, http).with_structured_output(Report, method=method, include_raw=True)
        out = structured.invoke("Weather in Oslo?")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Report)
    [body] = wire.bodies
    if method == "function_calling":
        assert body["tool_choice"]["type"] == "function" and not out["raw"].invalid_tool_calls
    else:
        fmt = body["text"]["format"] if api == "responses" else body["response_format"]["json_schema"]
        assert fmt["schema"]["properties"]["city"]["maxLength"] == 12


def readme_snippets(url: str) -> list:
    """The README's framework snippets, compiled to talk to url (and without this module's
    postponed annotations, which pydantic could not resolve in an exec'd namespace)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Use it from your agent framework\n", 1)[1].split("\n## ", 1)[0]
    return [compile(code.replace("http://127.0.0.1:8000", url), "README.md", "exec", dont_inherit=True)
            for code in re.findall(r"```python\n(.*?)```", section, re.S)]


def test_readme_snippets_run_as_written(server):
    agents_sdk, langchain, anthropic_sdk = readme_snippets(server)
    run: dict = {}
    exec(agents_sdk, run)
    assert run["result"].last_agent.name == "weather" and isinstance(run["result"].final_output, run["Report"])
    chat: dict = {}
    exec(langchain, chat)
    assert chat["reply"].tool_calls[0]["name"] == "get_weather" and isinstance(chat["report"], chat["Report"])
    messages: dict = {}
    exec(anthropic_sdk, messages)
    call, answer = messages["call"], messages["answer"]
    assert call.name == "get_weather" and call.input["city"] == "Paris"
    # The marked system prompt and the tools, at least, were read from the cache.
    assert answer.usage.cache_read_input_tokens > 0 and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
