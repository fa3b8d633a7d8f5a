"""tool_choice and response_format over HTTP, with the real openai client:
constrained replies parse and validate, streamed or not, and a request the
grammar cannot be built for is a 400 that leaves its session as it was."""
import json

import jsonschema
import openai
import pytest

from tests.test_server import USER, WEATHER_TOOL, chat, server  # noqa: F401  (server is a fixture)

FILE_TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "pattern": "^[a-z_./]{1,24}$"}}, "required": ["path"]}}}
TOOLS = [WEATHER_TOOL, FILE_TOOL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
VERDICT = {"type": "object", "required": ["verdict", "confidence"], "additionalProperties": False, "properties": {
    "verdict": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}}


def valid_calls(calls) -> list[str]:
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [call.function.name for call in calls]


@pytest.mark.parametrize("stream", [False, True])
def test_required_always_calls_an_offered_tool(server, stream):
    client = server.client()
    for i, prompt in enumerate(["Hello!", "Tell me a joke.", "What is in src/app.py?", "Weather in Oslo?"]):
        messages = [{"role": "user", "content": prompt}]
        r = chat(client, messages, tools=TOOLS, tool_choice="required", max_tokens=80, stream=stream,
                 parallel_tool_calls=False)
        if stream:
            chunks = list(r)
            calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
            finish = chunks[-1].choices[0].finish_reason
        else:
            calls, finish = r.choices[0].message.tool_calls or [], r.choices[0].finish_reason
        assert finish == "tool_calls" and len(valid_calls(calls)) == 1, (prompt, calls)


def test_named_function_is_the_one_called(server):
    r = chat(server.client(), USER, tools=TOOLS, max_tokens=80,
             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert valid_calls(r.choices[0].message.tool_calls) == ["get_weather"]


def test_json_schema_reply_validates(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}}
    for prompt in ("Is the build green?", "Should we ship?"):
        r = chat(server.client(), [{"role": "user", "content": prompt}], response_format=fmt, max_tokens=40)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), VERDICT)


@pytest.mark.parametrize("options, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm_rf"}}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "banana"}}}}, None),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_cannot_be_built_is_a_400_that_changes_nothing(server, options, param, stream):
    client, extra = server.client(), {"extra_body": {"session_id": "grammar-400"}}
    chat(client, USER, **extra)
    before = server.session_info("grammar-400")
    with pytest.raises(openai.BadRequestError) as e:
        r = chat(client, USER + [{"role": "user", "content": "again"}], stream=stream, **extra, **options)
        list(r) if stream else None
    error = e.value.body
    assert error["type"] == "invalid_request_error" and error["message"] and error["message"][0] != "["
    assert param is None or (error["param"] or "").startswith(param)
    server.wait_idle()
    after = server.session_info("grammar-400")
    assert (after["length"], after["pages"], len(after["turns"])) == (before["length"], before["pages"], len(before["turns"]))
    with server.http() as http:
        assert http.delete("/v1/sessions/grammar-400").status_code == 200
