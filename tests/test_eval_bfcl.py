"""experiments.benchmarks.eval_bfcl without a server: BFCL function docs as
OpenAI tools, the AST checker on hand-written items, irrelevance, and a
scripted multi-turn conversation on bfcl's real GorillaFileSystem."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("bfcl_eval")

# Before bfcl_eval.utils: the module points the folders bfcl makes on import away from site-packages.
from agentkv.experiments.benchmarks.eval_bfcl import check_ast, run_item, run_single_turn, standardize  # noqa: E402
from agentkv.experiments.workloads.bfcl import Item, Reply, openai_tools, run_multi_turn  # noqa: E402
from bfcl_eval.utils import populate_test_cases_with_predefined_functions  # noqa: E402, I001

AREA = {"name": "geometry.area", "description": "Area of a shape.", "parameters": {
    "type": "dict", "required": ["shape", "size"], "properties": {
        "shape": {"type": "string", "description": "The shape."},
        "size": {"type": "float", "description": "Its size."},
        "unit": {"type": "string", "description": "The unit."}}}}
AREA_ANSWER = {"geometry.area": {"shape": ["square"], "size": [2.0], "unit": ["cm", ""]}}
WEATHER = {"name": "weather", "description": "The weather.", "parameters": {
    "type": "dict", "required": ["city"], "properties": {"city": {"type": "string", "description": "A city."}}}}


def call(name: str, **args) -> dict:
    return {name: args}


def test_docs_become_openai_tools():
    doc = {"name": "a.b", "description": "d", "parameters": {"type": "dict", "required": ["x"], "properties": {
        "x": {"type": "float", "description": "x."},
        "pair": {"type": "tuple", "description": "p.", "items": {"type": "integer"}},
        "anything": {"type": "any", "description": "a."},
        "options": {"type": "dict", "description": "o.", "properties": {
            "depth": {"type": "float", "description": "d."},
            "rows": {"type": "array", "description": "r.", "items": {"type": "dict", "properties": {
                "k": {"type": "string", "description": "k."}}}}}}}}}
    [tool] = openai_tools([doc])
    assert tool["type"] == "function"
    fn = tool["function"]
    assert fn["name"] == "a_b" and fn["description"] == "d"
    params = fn["parameters"]
    assert params["type"] == "object" and params["required"] == ["x"]
    props = params["properties"]
    assert props["x"] == {"type": "number", "format": "float", "description": "x. This is a float type value."}
    assert props["pair"] == {"type": "array", "description": "p.", "items": {"type": "integer"}}
    assert props["anything"]["type"] == "string"  # BFCL checks "any" as a string
    options = props["options"]
    assert options["type"] == "object" and options["properties"]["depth"]["type"] == "number"
    assert options["properties"]["rows"]["items"]["type"] == "object"
    assert options["properties"]["rows"]["items"]["properties"]["k"]["type"] == "string"
    assert doc["parameters"]["type"] == "dict"  # the doc itself is left as it was


def test_a_response_schema_goes_into_the_description():
    response = {"type": "dict", "properties": {"ok": {"type": "boolean", "description": "Done."}}}
    [tool] = openai_tools([{**WEATHER, "response": response}])
    assert set(tool["function"]) == {"name", "description", "parameters"}
    assert tool["function"]["description"] == (
        "The weather. The response field has the following schema: " + json.dumps(response))


def test_a_matching_call_passes():
    assert check_ast([AREA], [call("geometry_area", shape="square", size=2.0)], [AREA_ANSWER], "simple_python") is None
    # Strings are compared after BFCL's normalization; an allowed optional value may be given.
    assert check_ast([AREA], [call("geometry_area", shape="Square ", size=2.0, unit="CM")], [AREA_ANSWER],
                     "simple_python") is None
    assert standardize("April 1, 2024") == standardize("april 1 2024")


def test_an_int_passes_for_a_float():
    assert check_ast([AREA], [call("geometry_area", shape="square", size=2)], [AREA_ANSWER], "simple_python") is None


@pytest.mark.parametrize("calls, error", [
    ([call("geometry_area", shape="circle", size=2.0)], "value_error:string"),
    ([call("geometry_area", shape="square", size=3.0)], "value_error:others"),
    ([call("geometry_area", shape="square", size="2")], "type_error"),
    ([call("geometry_area", shape="square")], "missing_required"),
    ([call("geometry_area", shape="square", size=2.0, color="red")], "unexpected_param"),
    ([call("area", shape="square", size=2.0)], "wrong_func_name"),
    ([], "wrong_count"),
])
def test_a_wrong_call_fails(calls, error):
    assert error in check_ast([AREA], calls, [AREA_ANSWER], "simple_python")


def test_a_left_out_optional_fails_unless_allowed():
    answer = {"geometry.area": {"shape": ["square"], "size": [2.0], "unit": ["cm"]}}
    assert "missing_optional" in check_ast([AREA], [call("geometry_area", shape="square", size=2.0)], [answer],
                                           "simple_python")


def test_multiple_checks_the_expected_function():
    answers = [{"weather": {"city": ["Paris"]}}]
    assert check_ast([AREA, WEATHER], [call("weather", city="paris")], answers, "multiple") is None
    assert "wrong_func_name" in check_ast([AREA, WEATHER], [call("geometry_area", shape="square", size=2.0)],
                                          answers, "multiple")


def test_parallel_calls_match_in_any_order():
    answers = [{"weather": {"city": ["Paris"]}}, {"weather": {"city": ["Rome"]}}]
    both = [call("weather", city="Rome"), call("weather", city="Paris")]
    assert check_ast([WEATHER], both, answers, "parallel") is None
    assert "cannot_find_match" in check_ast([WEATHER], [call("weather", city="Rome")] * 2, answers, "parallel")
    assert "wrong_count" in check_ast([WEATHER], both[:1], answers, "parallel")


def scripted(*replies: Reply):
    """A fake model: the replies in order; it keeps the messages of each request."""
    seen: list[list[dict]] = []

    def chat(messages: list[dict], tools: list[dict]) -> Reply:
        assert tools and all(t["type"] == "function" for t in tools)
        seen.append([dict(m) for m in messages])
        return replies[len(seen) - 1]

    chat.seen = seen
    return chat


def calls_reply(*calls: dict) -> Reply:
    return Reply(None, [{"id": f"call_{i}", "name": name, "arguments": json.dumps(args)}
                        for i, c in enumerate(calls) for name, args in c.items()])


def single_entry(*functions: dict) -> dict:
    return {"id": "x_0", "question": [[{"role": "user", "content": "?"}]], "function": list(functions)}


def test_irrelevance_passes_without_a_call():
    assert run_single_turn(scripted(Reply("I cannot help.")), single_entry(WEATHER), None, "irrelevance")["passed"]
    # An undecodable call is no call, for BFCL too.
    bad = Reply(None, [{"id": "c", "name": "weather", "arguments": "{not json"}])
    assert run_single_turn(scripted(bad), single_entry(WEATHER), None, "irrelevance")["passed"]
    made = run_single_turn(scripted(calls_reply(call("weather", city="Oslo"))), single_entry(WEATHER), None,
                           "irrelevance")
    assert not made["passed"] and made["calls"] == [call("weather", city="Oslo")]


def test_single_turn_records_the_verdict():
    reply = calls_reply(call("geometry_area", shape="square", size=2))
    assert run_single_turn(scripted(reply), single_entry(AREA), [AREA_ANSWER], "simple_python")["passed"]
    record = run_single_turn(scripted(Reply("2 cm")), single_entry(AREA), [AREA_ANSWER], "simple_python")
    assert not record["passed"] and "wrong_count" in record["reason"]


@pytest.mark.parametrize("category", ["simple_python", "multi_turn_base"])
def test_a_refused_request_fails_its_item_not_the_run(category):
    """A server's refusal (a conversation past the context: 413) is that item's failure."""
    import httpx
    import openai

    def refusing(messages, tools):
        request = httpx.Request("POST", "http://server/v1/chat/completions")
        raise openai.APIStatusError("prompt too long", response=httpx.Response(413, request=request), body=None)

    entry, answer = (single_entry(AREA), [AREA_ANSWER]) if category == "simple_python" else (file_system_entry(),
                                                                                            GROUND_TRUTH)
    made = run_item(refusing, Item(category, entry, answer), max_steps=8)
    assert not made["passed"] and made["reason"].startswith("request_error: APIStatusError")


def file_system_entry() -> dict:
    """Two user turns on bfcl's GorillaFileSystem, its function docs filled in by bfcl."""
    entry = {"id": "multi_turn_base_9999", "involved_classes": ["GorillaFileSystem"],
             "initial_config": {"GorillaFileSystem": {"root": {"alice": {"type": "directory", "contents": {
                 "notes.txt": {"type": "file", "content": "hello"}}}}}},
             "question": [[{"role": "user", "content": "Make a folder named temp."}],
                          [{"role": "user", "content": "What is in the current folder?"}]]}
    return populate_test_cases_with_predefined_functions([entry])[0]


GROUND_TRUTH = [["mkdir(dir_name='temp')"], ["ls()"]]


def test_multi_turn_state_matches_the_ground_truth():
    chat = scripted(calls_reply(call("mkdir", dir_name="temp")), Reply("Done."),
                    calls_reply(call("ls"), call("pwd")), Reply("notes.txt and temp."))
    record = run_multi_turn(chat, file_system_entry(), GROUND_TRUTH, max_steps=8)
    assert record["passed"], record["reason"]
    assert record["calls"] == [[[call("mkdir", dir_name="temp")]], [[call("ls"), call("pwd")]]]
    # Each call's result went back as a tool message answering its call, in order.
    last = chat.seen[-1]
    tools = [m for m in last if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tools] == ["call_0", "call_0", "call_1"]
    assert json.loads(tools[1]["content"]) == {"current_directory_content": ["notes.txt", "temp"]}
    assert json.loads(tools[2]["content"]) == {"current_working_directory": "/alice"}
    assert [m["role"] for m in last] == ["user", "assistant", "tool", "assistant", "user", "assistant", "tool", "tool"]


def test_multi_turn_fails_on_a_different_state():
    chat = scripted(calls_reply(call("mkdir", dir_name="tmp")), Reply("Done."), calls_reply(call("ls")), Reply("."))
    record = run_multi_turn(chat, file_system_entry(), GROUND_TRUTH, max_steps=8)
    assert not record["passed"] and record["reason"].startswith("multi_turn:instance_state_mismatch")


def test_multi_turn_fails_on_a_missing_ground_truth_result():
    # The state matches (ls changes nothing), but ls's listing never came back to the model.
    chat = scripted(calls_reply(call("mkdir", dir_name="temp")), Reply("Done."), Reply("I don't know."))
    record = run_multi_turn(chat, file_system_entry(), GROUND_TRUTH, max_steps=8)
    assert not record["passed"] and record["reason"].startswith("multi_turn:empty_turn_model_response")


def test_unknown_functions_are_not_executed():
    chat = scripted(calls_reply(call("open", file="/tmp/x", mode="w")), calls_reply(call("mkdir", dir_name="temp")),
                    Reply("Done."), calls_reply(call("ls")), Reply("."))
    record = run_multi_turn(chat, file_system_entry(), GROUND_TRUTH, max_steps=8)
    assert record["passed"], record["reason"]
    assert chat.seen[1][-1] == {"role": "tool", "content": "Error during execution: name 'open' is not defined",
                                "tool_call_id": "call_0"}


def test_a_turn_past_max_steps_ends_the_conversation():
    chat = scripted(*[calls_reply(call("pwd"))] * 2)
    record = run_multi_turn(chat, file_system_entry(), GROUND_TRUTH, max_steps=2)
    assert not record["passed"] and record["reason"].startswith("multi_turn:force_terminated")
    assert len(chat.seen) == 2
