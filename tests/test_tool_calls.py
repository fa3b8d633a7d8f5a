"""parse_tool_calls over replies as models write them, well and badly."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.model.tool_calls import (
    TOOL_CALL_FORMATS,
    detect_tool_call_format,
    format_of_template,
    parse_tool_calls,
    tool_choice_error,
)

CALL_ID = re.compile(r"call_[0-9a-f]{24}|[A-Za-z0-9]{9}")


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    for call in calls:
        assert CALL_ID.fullmatch(call["id"]) and set(call) == {"id", "name", "arguments"}
    return [(call["name"], call["arguments"]) for call in calls]


def test_hermes_several_calls_with_text_around():
    text = (
        "I'll read both files.\n"
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/a.py"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/b.py", "lines": [1, 20]}}\n</tool_call>\n'
        "Then I'll compare them."
    )
    content, calls = parse_tool_calls(text)
    assert content == "I'll read both files.\nThen I'll compare them."
    assert _calls(calls) == [("read_file", {"path": "src/a.py"}), ("read_file", {"path": "src/b.py", "lines": [1, 20]})]
    assert calls[0]["id"] != calls[1]["id"]


def test_hermes_call_only():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "list_directory", "arguments": {}}\n</tool_call>')
    assert content == "" and _calls(calls) == [("list_directory", {})]


def test_hermes_arguments_as_json_string_and_missing():
    text = ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Zürich\\"}"}</tool_call>'
            '<tool_call>{"name": "now"}</tool_call>')
    assert _calls(parse_tool_calls(text)[1]) == [("get_weather", {"city": "Zürich"}), ("now", {})]


def test_hermes_unclosed_last_block():
    # Generation stopped at EOS before the closing tag.
    content, calls = parse_tool_calls('Checking.\n<tool_call>\n{"name": "run_tests", "arguments": {"path": "tests/"}}\n')
    assert content == "Checking." and _calls(calls) == [("run_tests", {"path": "tests/"})]


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"\n</tool_call>',  # truncated JSON
    "<tool_call>\n{'name': 'read_file'}\n</tool_call>",  # not JSON
    '<tool_call>\n["read_file"]\n</tool_call>',  # not an object
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": "{not json"}\n</tool_call>',  # arguments string not JSON
    '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
])
def test_hermes_malformed_block_stays_in_text(block):
    good = '<tool_call>\n{"name": "ok", "arguments": {"x": 1}}\n</tool_call>'
    content, calls = parse_tool_calls(f"Before.\n{block}\n{good}\nAfter.")
    assert content == f"Before.\n{block}\nAfter."
    assert _calls(calls) == [("ok", {"x": 1})]
    assert parse_tool_calls(block) == (block, [])


def test_no_calls_leaves_text_untouched():
    for text in ["", "  Plain answer.\n", '{"name": "Ada", "age": 36}', "Use <tool_call> tags to call tools."]:
        assert parse_tool_calls(text) == (text, [])


def test_llama3_json():
    content, calls = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}')
    assert content == "" and _calls(calls) == [("get_weather", {"city": "Paris", "unit": "c"})]
    content, calls = parse_tool_calls('<|python_tag|>{"name": "search", "parameters": {"q": "kv cache"}}')
    assert content == "" and _calls(calls) == [("search", {"q": "kv cache"})]
    both = '{"name": "a", "parameters": {}}; {"name": "b", "arguments": "{\\"k\\": true}"}\n'
    assert _calls(parse_tool_calls(both)[1]) == [("a", {}), ("b", {"k": True})]


@pytest.mark.parametrize("text", [
    'Sure: {"name": "get_weather", "parameters": {"city": "Paris"}}',  # not the whole message
    '{"name": "get_weather", "parameters": {"city": "Paris"}',  # truncated
    '{"name": "get_weather", "parameters": {"city": "Paris"}} and more',
    '{"name": "get_weather"}',  # JSON for the user, not a call
])
def test_llama3_json_not_a_call(text):
    assert parse_tool_calls(text) == (text, [])


def test_format_restricts_parsing():
    llama = '{"name": "f", "parameters": {}}'
    hermes = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_tool_calls(llama, fmt="hermes") == (llama, [])
    assert parse_tool_calls(hermes, fmt="llama3_json") == (hermes, [])
    assert _calls(parse_tool_calls(hermes, fmt="hermes")[1]) == [("f", {})]
    with pytest.raises(ValueError):
        parse_tool_calls(llama, fmt="xml")


def test_detect_tool_call_format():
    assert detect_tool_call_format("{{ '<tool_call>' }}") == "hermes"
    assert detect_tool_call_format('{{ "<|python_tag|>" }}') == "llama3_json"
    assert detect_tool_call_format('<|start_header_id|>{"name": function name, "parameters": ...}') == "llama3_json"
    assert detect_tool_call_format("{{ messages[0].content }}") is None
    assert detect_tool_call_format(None) is None


json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(), c, max_size=3),
                           max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(text=st.text().map(lambda t: t.replace("<", "‹")), calls=st.lists(st.tuples(st.text(min_size=1), st.dictionaries(st.text(), json_values)), max_size=3),
       as_string=st.booleans())
def test_hermes_round_trip(text, calls, as_string):
    """Whatever the arguments, a well-formed block parses back to them; text never raises."""
    blocks = [json.dumps({"name": n, "arguments": json.dumps(a) if as_string else a}) for n, a in calls]
    reply = text + "".join(f"\n<tool_call>\n{b}\n</tool_call>" for b in blocks)
    content, parsed = parse_tool_calls(reply, fmt="hermes")
    assert _calls(parsed) == calls
    assert content == (text.strip() if calls else reply)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=list('{}[]":,; \n<>/|_abnmeprtolcsy0123456789')) | st.text())
def test_never_raises(text):
    content, calls = parse_tool_calls(text)
    assert isinstance(content, str) and all(isinstance(c["arguments"], dict) for c in calls)


@pytest.mark.parametrize("fmt", sorted(TOOL_CALL_FORMATS))
def test_a_format_parses_the_calls_its_grammar_syntax_writes(fmt):
    # What a grammar holds a call to (list_open, begin, call_end, separator,
    # list_close) is what the same format's parser reads back, in one call and in parallel ones.
    f = TOOL_CALL_FORMATS[fmt]
    city, empty = ('city="Oslo"', "") if f.python_arguments else ('{"city": "Oslo"}', "{}")
    one = f.begin("get_weather") + city + f.call_end
    two = f.begin("now") + empty + f.call_end
    for calls_text, want in [(one, [("get_weather", {"city": "Oslo"})]),
                             (one + f.separator + two, [("get_weather", {"city": "Oslo"}), ("now", {})])]:
        content, calls = f.parse(f.list_open + calls_text + f.list_close)
        assert _calls(calls) == want and content == ""
    written = f.list_open + one
    assert f.trigger in written and (f.unmarked or f.marker in written)


def test_format_of_template_defaults_to_hermes():
    assert format_of_template(None) is TOOL_CALL_FORMATS["hermes"]
    assert format_of_template('{{ "<|python_tag|>" }}') is TOOL_CALL_FORMATS["llama3_json"]


@pytest.mark.parametrize("choice,offered,error", [
    (None, [], None), ("auto", [], None), ("none", ["a"], None), ("required", ["a"], None),
    ("required", [], 'tool_choice "required" needs tools'),
    ({"type": "function", "function": {"name": "a"}}, ["a"], None),
    ({"type": "function", "name": "a"}, ["a"], None),
    ({"type": "function", "function": {"name": "b"}}, ["a"], "tool_choice names 'b', which is not among the tools"),
    ({"type": "function", "name": "b"}, [], "tool_choice names 'b', which is not among the tools"),
    ("sometimes", ["a"], "tool_choice must be"),
    ({"type": "function"}, ["a"], "tool_choice must be"),
])
def test_tool_choice_error_is_the_one_check_of_a_choice(choice, offered, error):
    got = tool_choice_error(choice, offered)
    assert got == error if error is None else got.startswith(error)
