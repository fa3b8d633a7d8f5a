"""Tool-call formats per model family (model.tool_formats), each with the
family's own chat template (tests/data/chat_templates, sources in its
LICENSES.md): the template selects the format, renders a conversation with
tools, calls and results, replies in the format parse (or stay text), a
parsed reply renders back as the model wrote it where the template says so,
and the grammar of a required or named tool choice makes even the untrained
embedded model call in the format, through the engine and over HTTP.

What an untrained model writes under tool_choice "auto" is not asserted: it
never opens a call, and greedy free text is no contract."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
import xgrammar as xgr
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from xgrammar.testing import _is_grammar_accept_string

from agentkv import Engine
from agentkv.engine.api import create_app
from agentkv.engine.grammar import GrammarError, GrammarState
from agentkv.engine.python_args import kwargs_grammar
from agentkv.engine.structured import request_grammar, structural_tag
from agentkv.engine.turn import reply_message
from agentkv.model.chat_suffix import reply_gap, render_suffix
from agentkv.model.default import SMALL_MODEL_DIR
from agentkv.model.tokenizer import IncrementalDecoder, Tokenizer
from agentkv.model.tool_calls import TOOL_CALL_FORMATS, detect_tool_call_format

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
# Every value bounded (enums, booleans, no free strings or numbers), so that an
# untrained model held to the grammar closes its call within a few tokens.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "metric": {"type": "boolean"}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@dataclass(frozen=True)
class Family:
    format: str
    end: str  # what the template writes to end the assistant's turn (with the embedded tokenizer's tokens)
    round_trips: tuple[str, ...]  # replies the template renders back as written
    gap: str | None  # what the template writes after a reply that ended on `end`; None: no native continuation


FAMILIES = {
    # The v3 template moves the system prompt into the last user message: a reply never renders as the prompt's tail.
    "mistral_v3_parallel": Family("mistral", "<|im_end|>", (), None),
    "mistral_v11": Family("mistral_v11", "<|im_end|>", (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "metric": true}',
        'Checking both.[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}[TOOL_CALLS]now[ARGS]{}'), ""),
    # Phi-4-mini's template ends every render with <|assistant|>: the engine re-renders instead.
    "phi4_mini": Family("phi4_mini", "<|end|>", (), None),
    # Llama 3.2's template writes strings unquoted, Llama 4's every value quoted, Gemma 3's
    # loses the comma between arguments: each renders back only the calls below.
    "llama3.2_pythonic": Family("pythonic", "<|eot_id|>", ("[set_units(metric=True)]", "[now(), now()]"), ""),
    "llama4_pythonic": Family("pythonic", "<|eot|>", ('[get_weather(city="Oslo")]',
                                                      '[get_weather(city="Lima"), now()]'), ""),
    "gemma3_pythonic": Family("pythonic", "<end_of_turn>", ('[get_weather(city="Oslo")]',
                                                           '[get_weather(city="Lima"), now()]'), "\n"),
}


@pytest.fixture(scope="module")
def base() -> Tokenizer:
    return Tokenizer.from_dir(SMALL_MODEL_DIR)


def tokenizer(base: Tokenizer, family: str) -> Tokenizer:
    return base.with_chat_template((TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8"))


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["name"], c["arguments"]) for c in calls]


def test_every_shipped_template_is_licensed():
    licenses = (TEMPLATES / "LICENSES.md").read_text(encoding="utf-8")
    assert {p.name for p in TEMPLATES.glob("*.jinja")} == {f"{f}.jinja" for f in FAMILIES}
    assert all(f"{family}.jinja" in licenses for family in FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_template_selects_its_format(base, family):
    tok = tokenizer(base, family)
    assert detect_tool_call_format(tok.chat_template) == FAMILIES[family].format
    assert tok.tool_call_format is TOOL_CALL_FORMATS[FAMILIES[family].format]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_template_renders_tools_calls_and_results(base, family):
    tok = tokenizer(base, family)
    fmt = tok.tool_call_format
    city = 'city="Lima"' if fmt.python_arguments else '{"city": "Lima"}'
    written = fmt.list_open + fmt.begin("get_weather") + city + fmt.call_end + fmt.list_close
    content, calls = fmt.parse(written)
    assert calls_of(calls) == [("get_weather", {"city": "Lima"})] and content == ""
    messages = ASK + [reply_message(content, calls),
                      {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temp_c": 19}'}]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    asked = text.index("What is the weather in Oslo?")
    assert "get_weather" in text[asked:] and "Lima" in text[asked:] and "19" in text[asked:]
    # The tools are listed, except by Llama 4's template, which lists them only beside a system message.
    assert '"now"' in text or family == "llama4_pythonic"


PARSED = {
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "", [("get_weather", {"city": "Oslo"})]),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}]', "",
         [("get_weather", {"city": "Oslo"}), ("now", {})]),
        ('Let me look.\n[TOOL_CALLS] [{"name": "now", "arguments": "{}"}]', "Let me look.", [("now", {})]),
        # Decoding may drop the marker, a special token in Mistral's vocabularies.
        ('[{"name": "now", "arguments": {}}]', "", [("now", {})]),
    ],
    "mistral_v11": [
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', "", [("get_weather", {"city": "Oslo"})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]now[ARGS]{}', "",
         [("get_weather", {"city": "Oslo"}), ("now", {})]),
        ("Checking.[TOOL_CALLS]now[ARGS]{} Done.", "Checking.\nDone.", [("now", {})]),
    ],
    "phi4_mini": [
        ('functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "", [("get_weather", {"city": "Oslo"})]),
        ('functools[{"name": "now", "arguments": {}}, {"name": "now", "arguments": {}}]', "", [("now", {}), ("now", {})]),
        ('Sure. functools[{"name": "now", "arguments": {}}]', "Sure.", [("now", {})]),
    ],
    "pythonic": [
        ('[get_weather(city="Oslo")]', "", [("get_weather", {"city": "Oslo"})]),
        ('\n[get_weather(city="Oslo", metric=False), now()]\n', "", [("get_weather", {"city": "Oslo", "metric": False}),
                                                                  ("now", {})]),
        ("<|python_start|>[now()]<|python_end|>", "", [("now", {})]),
        ("```tool_code\n[now()]\n```", "", [("now", {})]),
        # JSON's literals, which templates that tojson the arguments teach the model.
        ("[f(a=true, b=null, c=[1, 2.5], d={'k': 'v'}, e=-3)]", "",
         [("f", {"a": True, "b": None, "c": [1, 2.5], "d": {"k": "v"}, "e": -3})]),
    ],
}
NOT_CALLS = {
    "mistral": ['[TOOL_CALLS] [{"name": "now", "arguments": {}}',  # truncated
                '[TOOL_CALLS] [{"arguments": {}}]', '[TOOL_CALLS] []', '[TOOL_CALLS] [{"name": "now"}] and more',
                '[{"name": "Ada"}]',  # JSON for the user: no arguments, no marker
                '[TOOL_CALLS] [{"name": "now", "arguments": [1]}]'],
    "mistral_v11": ["[TOOL_CALLS]now{}", "[TOOL_CALLS]get weather[ARGS]{}", '[TOOL_CALLS]now[ARGS]{"a": ',
                    "[TOOL_CALLS]now[ARGS][1]", "[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]", "[ARGS]{}"],
    "phi4_mini": ['functools[{"name": "now"', "functools[]", 'functools[{"name": "now", "arguments": {}}] and more',
                  "functools are handy"],
    "pythonic": ["Here: [now()]", "[now(]", "[now(1)]", '[os.system("ls")]', "[now(**kw)]",
                 '[now(a=__import__("os"))]', "[f(a=1+1)]", "[f(a=x)]", "[]", "[1, 2]", "[" * 300 + "]" * 300,
                 "[now()] and then", "[f(a={[1]: 2})]", "[f(a={1, 2})]", '[f(a=b"x")]', "[f(a=...)]",
                 "[f(a=1j)]", "[f(a=1e999)]", "[f(a={1: 2})]", '[f(a=-"x")]'],
}


@pytest.mark.parametrize("fmt,reply,content,calls", [(f, *case) for f, cases in PARSED.items() for case in cases])
def test_replies_in_the_format_parse(fmt, reply, content, calls):
    got_content, got = TOOL_CALL_FORMATS[fmt].parse(reply)
    assert (got_content, calls_of(got)) == (content, calls)
    assert len({c["id"] for c in got}) == len(got)


@pytest.mark.parametrize("fmt,reply", [(f, r) for f, replies in NOT_CALLS.items() for r in replies])
def test_malformed_calls_stay_text(fmt, reply):
    assert TOOL_CALL_FORMATS[fmt].parse(reply) == (reply, [])


@settings(max_examples=150, deadline=None)
@given(fmt=st.sampled_from(sorted(TOOL_CALL_FORMATS)),
       text=st.lists(st.sampled_from(list('[](){}"=:,. \nabfnotuxTN_019') + ["[TOOL_CALLS]", "[ARGS]", "functools",
                                                                            '"name": ', '"arguments": '])).map("".join)
       | st.text())
def test_no_reply_raises(fmt, text):
    content, calls = TOOL_CALL_FORMATS[fmt].parse(text)
    assert isinstance(content, str) and all(isinstance(c["arguments"], dict) for c in calls)


def test_mistral_calls_get_the_ids_its_templates_accept():
    _, calls = TOOL_CALL_FORMATS["mistral"].parse('[TOOL_CALLS] [{"name": "now", "arguments": {}}]')
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()


@pytest.mark.parametrize("family,reply", [(f, r) for f, fam in FAMILIES.items() for r in fam.round_trips])
def test_a_parsed_reply_renders_as_written(base, family, reply):
    """render(parse(reply)) == reply, and the engine's native continuation
    (model.chat_suffix.reply_gap) finds the reply as the model said it."""
    tok, fam = tokenizer(base, family), FAMILIES[family]
    message = reply_message(*tok.tool_call_format.parse(reply))
    prompt = tok.apply_chat_template(ASK, tools=TOOLS, tokenize=False)
    rendered = tok.apply_chat_template(ASK + [message], tools=TOOLS, tokenize=False, add_generation_prompt=False)
    assert rendered == prompt + reply + fam.end + fam.gap
    assert reply_gap(tok, ASK, message, TOOLS, reply + fam.end, fam.end) == fam.gap


def test_mistral_v3_renders_the_calls_it_parsed(base):
    """Its template adds each call's id, so the text differs, but the calls read back the same."""
    tok = tokenizer(base, "mistral_v3_parallel")
    reply = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}]'
    content, calls = tok.tool_call_format.parse(reply)
    rendered = tok.apply_chat_template(ASK + [reply_message(content, calls)], tools=TOOLS, tokenize=False,
                                       add_generation_prompt=False)
    said = rendered[rendered.rindex("[TOOL_CALLS]"):].removesuffix("<|im_end|>")
    assert calls_of(tok.tool_call_format.parse(said)[1]) == calls_of(calls)


@pytest.mark.parametrize("family", [f for f, fam in FAMILIES.items() if fam.gap is None])
def test_templates_that_cannot_continue_natively_say_so(base, family):
    """The engine then re-renders the conversation (template-faithful), reusing its common prefix."""
    tok = tokenizer(base, family)
    content, calls = tok.tool_call_format.parse(
        tok.tool_call_format.list_open + tok.tool_call_format.begin("now") + "{}" + tok.tool_call_format.call_end
        + tok.tool_call_format.list_close)
    messages = ASK + [reply_message(content, calls)]
    result = {"role": "tool", "tool_call_id": calls[0]["id"], "content": "12:00"}
    assert (reply_gap(tok, ASK, messages[-1], TOOLS, "x" + FAMILIES[family].end, FAMILIES[family].end) is None
            or render_suffix(tok, messages + [result], len(messages), TOOLS) is None)


def test_pythonic_arguments_are_held_to_the_schema():
    assert not _is_grammar_accept_string(xgr.Grammar.from_ebnf(kwargs_grammar("now", SCHEMAS["now"])), "x=1")
    grammar = xgr.Grammar.from_ebnf(kwargs_grammar("get_weather", SCHEMAS["get_weather"]))
    for text, ok in [('city="Oslo"', True), ('city="Lima", metric=True', True), ("metric=True", False),
                     ('city="Rome"', False), ('metric=True, city="Oslo"', False), ('city="Oslo", extra=1', False),
                     ("city='Oslo'", False)]:
        assert _is_grammar_accept_string(grammar, text) is ok, text
    nested = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                               "opts": {"type": "object", "properties": {"x": {"type": "null"}}}}}
    grammar = xgr.Grammar.from_ebnf(kwargs_grammar("f", nested))
    for text, ok in [('tags=["a", "b"], opts={"x": None}', True), ("opts={}", True), ("tags=[1]", False),
                     (r'tags=["q\"\\\n\u00e9"]', True), (r'tags=["\q"]', False), (r'tags=["\x41"]', False)]:
        assert _is_grammar_accept_string(grammar, text) is ok, text


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "object", "properties": {"path": {"type": "string", "pattern": "^a"}}}, "pattern"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}, "minimum"),
    ({"type": "object", "properties": {"x": {"oneOf": [{"type": "string"}]}}}, "oneOf"),
    ({"type": "object", "properties": {"not-an-identifier": {"type": "string"}}}, "cannot be a Python keyword"),
    ({"type": "object", "properties": {"class": {"type": "string"}}}, "cannot be a Python keyword"),
])
def test_what_pythonic_arguments_cannot_hold_is_refused(schema, keyword):
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    with pytest.raises(GrammarError, match=keyword):
        structural_tag(tools, "required", None, TOOL_CALL_FORMATS["pythonic"])


@pytest.mark.parametrize("fmt", ["mistral", "mistral_v11", "phi4_mini", "pythonic"])
def test_auto_leaves_text_free_and_holds_what_opens_calls(fmt):
    f = TOOL_CALL_FORMATS[fmt]
    grammar = xgr.Grammar.from_structural_tag(json.dumps(structural_tag(TOOLS, "auto", None, f)))
    args = 'city="Oslo"' if f.python_arguments else '{"city": "Oslo"}'
    call = f.list_open + f.begin("get_weather") + args + f.call_end + f.list_close
    bad = f.list_open + f.begin("get_weather") + ('city="Rome"' if f.python_arguments else '{"city": "Rome"}')
    assert _is_grammar_accept_string(grammar, "Plain text, no call.")
    assert _is_grammar_accept_string(grammar, call)
    assert not _is_grammar_accept_string(grammar, bad + f.call_end + f.list_close)


# End to end: the engine with each family's template, the embedded model's untrained weights.


@pytest.fixture(scope="module")
def engines(base) -> dict[str, Engine]:
    first = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=256)
    return {f: Engine(first.model, tokenizer(base, f), num_pages=256) for f in FAMILIES}


def valid(name: str, arguments: dict) -> str:
    jsonschema.validate(arguments, SCHEMAS[name])
    return name


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("choice", ["required", "named"])
def test_the_grammar_forces_a_call_in_the_format(engines, family, choice):
    engine = engines[family]
    r = engine.chat(ASK, TOOLS, tool_choice=NAMED if choice == "named" else "required", parallel_tool_calls=False,
                    max_tokens=96, temperature=0.0)
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1, r.text
    name = valid(r.tool_calls[0]["name"], r.tool_calls[0]["arguments"])
    assert choice == "required" or name == "get_weather"
    # In the format's own syntax: the reply as said parses in it alone.
    said = engine.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    assert calls_of(engine.tokenizer.tool_call_format.parse(said)[1]) == calls_of(r.tool_calls)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("stream", [False, True])
def test_the_api_returns_the_forced_call_as_tool_calls(engines, family, stream):
    body = {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 96,
            "temperature": 0.0}
    with TestClient(create_app(engines[family], "m")) as client:
        if not stream:
            choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
            calls, finish, content = choice["message"]["tool_calls"], choice["finish_reason"], choice["message"]["content"]
        else:
            calls, finish, content = [], None, ""
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        for c in json.loads(line[len("data: "):])["choices"]:
                            calls += c["delta"].get("tool_calls") or []
                            content += c["delta"].get("content") or ""
                            finish = c["finish_reason"] or finish
    assert finish == "tool_calls" and not content
    assert [valid(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == ["get_weather"]


def test_a_forced_mistral_v11_call_continues_natively(engines):
    """The one family whose template ends a reply with the embedded model's own
    end of turn (eos_token): its next turn reuses the reply's KV as sampled."""
    engine = engines["mistral_v11"]
    with engine.session() as s:
        first = engine.chat(ASK, TOOLS, session=s, tool_choice=NAMED, max_tokens=96, temperature=0.0)
        assert first.tool_calls and s.message_log is not None
        held = s.message_log.length
        messages = ASK + [reply_message(first.text, first.tool_calls),
                          {"role": "tool", "tool_call_id": first.tool_calls[0]["id"], "content": '{"temp_c": 4}'}]
        second = engine.chat(messages, TOOLS, session=s, max_tokens=4, temperature=0.0)
        assert second.usage["native"] and second.usage["cached_tokens"] >= held - 1


# Markers that are special tokens, as [TOOL_CALLS] and [ARGS] are in Mistral's vocabularies.


@pytest.fixture(scope="module")
def mistral_vocab(tmp_path_factory) -> Tokenizer:
    """The embedded tokenizer with two of its added tokens renamed [TOOL_CALLS]
    and [ARGS] and made special (same ids: the model has their embeddings),
    and the mistral_v11 template."""
    d = tmp_path_factory.mktemp("mistral_vocab")
    renames = {"<tool_response>": "[TOOL_CALLS]", "</tool_response>": "[ARGS]"}
    tokens = json.loads((SMALL_MODEL_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    for token in tokens["added_tokens"]:
        if token["content"] in renames:
            token.update(content=renames[token["content"]], special=True)
    config = json.loads((SMALL_MODEL_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = (TEMPLATES / "mistral_v11.jinja").read_text(encoding="utf-8")
    (d / "tokenizer.json").write_text(json.dumps(tokens), encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (d / "generation_config.json").write_bytes((SMALL_MODEL_DIR / "generation_config.json").read_bytes())
    return Tokenizer.from_dir(d)


def test_special_markers_stay_in_a_replys_text(mistral_vocab):
    tok = mistral_vocab
    assert sorted(tok.tool_markers.values()) == ["[ARGS]", "[TOOL_CALLS]"]
    reply = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]now[ARGS]{}'
    ids = tok.encode(reply)
    assert set(tok.tool_markers) <= set(ids)
    assert "[TOOL_CALLS]" not in tok.decode(ids, skip_special_tokens=True)  # what plain decoding loses
    assert tok.decode_reply(ids, tok.tool_markers) == reply
    decoder = IncrementalDecoder(tok, skip_special_tokens=True, keep=tok.tool_markers)
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == reply
    assert calls_of(tok.tool_call_format.parse(reply)[1]) == [("get_weather", {"city": "Oslo"}), ("now", {})]


def test_a_grammar_writes_special_markers_as_their_tokens(mistral_vocab, engines):
    engine = Engine(engines["mistral_v11"].model, mistral_vocab, num_pages=256)
    marker = next(i for i, t in mistral_vocab.tool_markers.items() if t == "[TOOL_CALLS]")
    state = GrammarState(request_grammar(engine, TOOLS, NAMED))
    assert state.clip([marker]) == [marker]
    r = engine.chat(ASK, TOOLS, tool_choice=NAMED, max_tokens=96, temperature=0.0)
    assert r.finish_reason == "tool_calls" and [valid(c["name"], c["arguments"]) for c in r.tool_calls] == ["get_weather"]
    with TestClient(create_app(engine, "m")) as client:
        body = {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 96, "stream": True}
        chunks = []
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["delta"] for chunk in chunks for c in chunk["choices"]]
    assert not "".join(d.get("content") or "" for d in deltas)
    assert [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls") or []] == ["get_weather"]
