"""Every request field OpenAI documents for chat completions and the
Responses API (as the openai client's types declare them) is accepted: it is
implemented, or ignored (the reply is exactly the one without it, as greedy
decoding makes it), or refused at any but its neutral value (a 400 naming
it). A field OpenAI does not document is still a 400 naming it. Driven over
in-process ASGI on the embedded default model, which follows a directive to
call a tool."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient

from agentkv import Engine
from agentkv.engine.api import create_app
from agentkv.engine.api.responses_schemas import Response
from agentkv.model.default import SMALL_MODEL_DIR
from tests.conftest import assert_all_pages_free
from tests.test_responses_api import CHAT_TOOL, MODEL, TOOL, ask

GEN = 24
REPORT = {
    "type": "object", "additionalProperties": False, "required": ["city", "sky"],
    "properties": {"city": {"type": "string", "maxLength": 12}, "sky": {"enum": ["sunny", "cloudy", "rainy"]}},
}


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=1024)


@pytest.fixture(scope="module")
def http(engine):
    with TestClient(create_app(engine, MODEL)) as client:
        yield client
    assert_all_pages_free(engine)


def chat(http: TestClient, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [ask("Paris")], "tools": [CHAT_TOOL], "temperature": 0.0, "max_tokens": GEN}
    return http.post("/v1/chat/completions", json={**body, **fields})


def respond(http: TestClient, **fields) -> httpx.Response:
    body = {"model": MODEL, "input": [ask("Paris")], "tools": [TOOL], "temperature": 0.0, "max_output_tokens": GEN}
    return http.post("/v1/responses", json={**body, **fields})


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def chat_reply(body: dict) -> tuple:
    m = body["choices"][0]["message"]
    return m["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()]


def outputs(body: dict) -> list:
    return [(o["type"], o["name"], o["arguments"]) if o["type"] == "function_call" else (o["type"], o["content"][0]["text"])
            for o in body["output"]]


def refused(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param.split(".")[0] in error["message"]
    return error


# Chat completions.

CHAT_IGNORED = [
    ("metadata", {"run": "7", "agent": "triage"}),
    ("store", True),
    ("modalities", ["text"]),
    ("prediction", {"type": "content", "content": '{"city": "Paris"}'}),
    ("reasoning_effort", "low"),
    ("service_tier", "flex"),
    ("verbosity", "low"),
    ("prompt_cache_key", "agent-7"),
    ("prompt_cache_retention", "24h"),
    ("prompt_cache_options", {"mode": "explicit", "ttl": "30m"}),
    ("safety_identifier", "d41d8cd98f00b204"),
    ("user", "someone"),
    ("top_logprobs", 0),
    ("logit_bias", {}),
]


@pytest.fixture(scope="module")
def chat_base(http) -> dict:
    return ok(chat(http))


@pytest.mark.parametrize("field,value", CHAT_IGNORED, ids=[f for f, _ in CHAT_IGNORED])
def test_chat_ignored_field_changes_nothing(http, chat_base, field, value):
    body = ok(chat(http, **{field: value}))
    assert chat_reply(body) == chat_reply(chat_base)
    assert body["usage"]["prompt_tokens"] == chat_base["usage"]["prompt_tokens"]
    assert body["service_tier"] == "default"  # the tier that served it, whatever was asked


def test_chat_stream_options_obfuscation_changes_nothing(http, chat_base):
    stream = chat(http, stream=True, stream_options={"include_usage": True, "include_obfuscation": True})
    assert stream.status_code == 200
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    calls = [c["function"] for chunk in chunks for choice in chunk["choices"] for c in choice["delta"].get("tool_calls", ())]
    assert [(c["name"], c["arguments"]) for c in calls] == chat_reply(chat_base)[1]
    usage, base = chunks[-1]["usage"], chat_base["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (base["prompt_tokens"], base["completion_tokens"])
    assert all("obfuscation" not in chunk for chunk in chunks)


CHAT_REFUSED = [
    ("n", 2),
    ("logprobs", True),
    ("top_logprobs", 2),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("web_search_options", {}),
    ("functions", [CHAT_TOOL["function"]]),
    ("function_call", "auto"),
    ("logit_bias", {"42": 5}),
    ("moderation", {"model": "omni-moderation-latest"}),
    ("presence_penalty", 0.5),
]


@pytest.mark.parametrize("field,value", CHAT_REFUSED, ids=[f for f, _ in CHAT_REFUSED])
def test_chat_field_beyond_the_engine_is_refused_by_name(http, field, value):
    assert refused(chat(http, **{field: value}), field)["code"] == "unsupported_parameter"


CHAT_MISSPELLED = [
    ("metdata", {"run": "7"}, "metdata"),
    ("reasoning_efort", "low", "reasoning_efort"),
    ("stream_options", {"include_obfuscaton": True}, "stream_options.include_obfuscaton"),
    ("prediction", {"type": "content", "content": "x", "contnt": "x"}, "prediction.contnt"),
    ("prompt_cache_options", {"ttl": "12h"}, "prompt_cache_options.ttl"),  # Responses only
    ("metadata", {str(i): "x" for i in range(17)}, "metadata"),  # OpenAI's limit is 16 pairs
    ("service_tier", "ultrafast", "service_tier"),  # Responses only
]


@pytest.mark.parametrize("field,value,param", CHAT_MISSPELLED, ids=[p for _, _, p in CHAT_MISSPELLED])
def test_chat_undocumented_field_is_a_400_naming_it(http, field, value, param):
    refused(chat(http, **{field: value}), param)


# The Responses API.

RESPONSES_ECHOED = [
    ("metadata", {"run": "7", "agent": "triage"}),
    ("user", "someone"),
    ("reasoning", {"effort": "low", "summary": "auto", "generate_summary": None, "context": "auto", "mode": "standard"}),
    ("text", {"format": {"type": "text"}, "verbosity": "low"}),
    ("truncation", "disabled"),
    ("max_tool_calls", 3),
    ("top_logprobs", 0),
    ("parallel_tool_calls", True),
    ("prompt_cache_key", "agent-7"),
    ("prompt_cache_retention", "24h"),
    ("safety_identifier", "d41d8cd98f00b204"),
    ("background", False),
    ("store", True),
]
RESPONSES_IGNORED = [
    ("include", ["reasoning.encrypted_content", "file_search_call.results", "web_search_call.action.sources",
                 "message.input_image.image_url", "code_interpreter_call.outputs"]),
    ("service_tier", "priority"),
    ("prompt_cache_options", {"mode": "implicit", "ttl": "12h", "comparison_response_id": "resp_0", "prewarm": False}),
    ("background_options", {"completion_window": "soonest"}),
    ("image", {"context_compression": "auto"}),
    ("access_programs", {"cyber": "standard"}),
    ("context_management", []),
]


@pytest.fixture(scope="module")
def responses_base(http) -> dict:
    return ok(respond(http))


@pytest.mark.parametrize("field,value", RESPONSES_ECHOED + RESPONSES_IGNORED,
                         ids=[f for f, _ in RESPONSES_ECHOED + RESPONSES_IGNORED])
def test_responses_ignored_field_changes_nothing(http, responses_base, field, value):
    body = ok(respond(http, **{field: value}))
    assert outputs(body) == outputs(responses_base)
    assert body["usage"]["input_tokens"] == responses_base["usage"]["input_tokens"]
    assert body["service_tier"] == "default"
    if (field, value) in RESPONSES_ECHOED:
        assert body[field] == value


def test_responses_stream_options_obfuscation_changes_nothing(http, responses_base):
    r = respond(http, stream=True, stream_options={"include_obfuscation": False})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.completed"
    assert outputs(events[-1]["response"]) == outputs(responses_base)


RESPONSES_REFUSED = [
    ("include", ["message.output_text.logprobs"]),
    ("top_logprobs", 3),
    ("background", True),
    ("conversation", "conv_123"),
    ("prompt", {"id": "pmpt_123"}),
    ("context_management", [{"type": "compaction", "compact_threshold": 1000}]),
    ("prompt_cache_options", {"prewarm": True}),
    ("moderation", {"model": "omni-moderation-latest"}),
]


@pytest.mark.parametrize("field,value", RESPONSES_REFUSED, ids=[f for f, _ in RESPONSES_REFUSED])
def test_responses_field_beyond_the_engine_is_refused_by_name(http, field, value):
    assert refused(respond(http, **{field: value}), field)["code"] == "unsupported_parameter"


def test_responses_logprobs_refusal_says_why(http):
    error = refused(respond(http, include=["message.output_text.logprobs"]), "include")
    assert "no logprobs" in error["message"]


RESPONSES_MISSPELLED = [
    pytest.param("includes", [], "includes", id="includes"),
    pytest.param("include", ["message.output_text.logprob"], "include.0", id="include-value"),
    pytest.param("text", {"formt": {"type": "text"}}, "text.formt", id="text.formt"),
    pytest.param("text", {"format": {"type": "json_schema", "name": "r"}}, "text.format.json_schema.schema",
                 id="text.format-without-schema"),
    # Chat's nesting is not the Responses shape.
    pytest.param("text", {"format": {"type": "json_schema", "name": "r", "schema": REPORT, "json_schema": {"name": "r"}}},
                 "text.format.json_schema.json_schema", id="text.format-chat-shape"),
    pytest.param("reasoning", {"efort": "low"}, "reasoning.efort", id="reasoning.efort"),
    pytest.param("truncation", "sometimes", "truncation", id="truncation-value"),
    pytest.param("metadata", {"k" * 65: "x"}, "metadata." + "k" * 65 + ".[key]", id="metadata-long-key"),
    # Chat's: the Responses API nests it in reasoning.
    pytest.param("reasoning_effort", "low", "reasoning_effort", id="reasoning_effort"),
]


@pytest.mark.parametrize("field,value,param", RESPONSES_MISSPELLED)
def test_responses_undocumented_field_is_a_400_naming_it(http, field, value, param):
    refused(respond(http, **{field: value}), param)


def echoed(fmt: dict) -> dict:
    return {k: v for k, v in fmt.items() if v is not None}


@pytest.mark.parametrize("prompt,fmt", [
    ("Reply in JSON.", {"type": "json_object"}),
    ("Weather in Oslo?", {"type": "json_schema", "name": "report", "schema": REPORT, "strict": True}),
    ("Weather in Oslo?", {"type": "json_schema", "name": "report", "description": "A weather report.", "schema": REPORT,
                          "strict": False}),
], ids=["json_object", "json_schema-strict", "json_schema"])
def test_text_format_holds_the_reply_as_chat_response_format_does(http, prompt, fmt):
    body = ok(respond(http, input=prompt, tools=None, text={"format": fmt}, max_output_tokens=48))
    [message] = body["output"]
    assert body["status"] == "completed"
    reply = json.loads(message["content"][0]["text"])
    assert isinstance(reply, dict)
    if fmt["type"] == "json_schema":
        jsonschema.validate(reply, REPORT)
    assert echoed(body["text"]["format"]) == fmt
    spec = {k: v for k, v in fmt.items() if k != "type"}
    response_format = {"type": fmt["type"], "json_schema": spec} if spec else fmt
    same = ok(chat(http, messages=[{"role": "user", "content": prompt}], tools=None, max_tokens=48,
                   response_format=response_format))
    assert chat_reply(same) == (message["content"][0]["text"], [])


def test_text_format_streams_stores_and_continues(http):
    fmt = {"type": "json_schema", "name": "report", "schema": REPORT, "strict": True}
    r = respond(http, input="Weather in Oslo?", tools=None, text={"format": fmt}, max_output_tokens=48, stream=True)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    done = events[-1]["response"]
    assert echoed(events[0]["response"]["text"]["format"]) == fmt and echoed(done["text"]["format"]) == fmt
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    jsonschema.validate(json.loads(text), REPORT)
    assert echoed(http.get(f"/v1/responses/{done['id']}").json()["text"]["format"]) == fmt
    stored = http.app.state.api.responses.get(done["id"], "default").response
    assert Response.model_validate(stored.model_dump(mode="json")) == stored  # as --state-dir saves and loads it
    # The format is the request's, as at OpenAI: a continuation without one is plain text.
    again = ok(respond(http, input="And in Rome?", tools=None, previous_response_id=done["id"]))
    assert again["text"]["format"] == {"type": "text"}
    assert again["usage"]["input_tokens_details"]["cached_tokens"] >= done["usage"]["input_tokens"]


def test_text_format_schema_that_cannot_compile_is_a_400(http):
    r = respond(http, tools=None, text={"format": {"type": "json_schema", "name": "r", "schema": {"type": "nonsense"}}})
    assert r.status_code == 400, r.text


def test_truncation_auto_drops_the_oldest_items_until_it_fits(http, engine):
    cities = ["Bern", "Kyiv", "Quito", "Lima", "Oslo", "Riga", "Baku", "Nuuk"]
    root = ok(respond(http, input=[ask(c) for c in cities[:-1]], tool_choice="required"))
    budget = 300
    max_output = engine.max_context - budget
    continuation = {"input": [ask(cities[-1])], "previous_response_id": root["id"], "max_output_tokens": max_output,
                    "tool_choice": {"type": "function", "name": "get_weather"}}
    assert respond(http, **continuation).status_code == 413  # truncation "disabled", the default
    body = ok(respond(http, truncation="auto", **continuation))
    assert body["truncation"] == "auto" and [o[0] for o in outputs(body)] == ["function_call"]
    # The prompt is the newest messages that fit, rendered as a whole conversation would be.
    calls = [{"id": o["call_id"], "type": "function", "function": {"name": o["name"], "arguments": o["arguments"]}}
             for o in root["output"]]
    history = [ask(c) for c in cities[:-1]] + [{"role": "assistant", "content": None, "tool_calls": calls}, ask(cities[-1])]
    rendered = [engine.tokenizer.apply_chat_template(history[start:], tools=[CHAT_TOOL]) for start in range(len(history))]
    kept = next(start for start, prompt in enumerate(rendered) if len(prompt) <= budget)
    assert 0 < kept and body["usage"]["input_tokens"] == len(rendered[kept])
    stored = http.app.state.api.responses.get(body["id"], "default").session
    assert stored.tokens[: len(rendered[kept])] == rendered[kept]
