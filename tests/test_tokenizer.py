"""The tokenizer and chat templates, checked against transformers as the reference.

Three templates: the embedded default, and Qwen2.5- and Llama-3.1-style ones
written from the public originals (close, not byte-exact). Each is rendered by
model.tokenizer and by transformers' apply_chat_template over the same
conversations: the strings and the ids must be equal, and where transformers
raises, we raise TokenizerError.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference must never reach for the hub

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tokenizers import AddedToken  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from agentkv.experiments.default_model.tokenizer import (  # noqa: E402
    CHAT_TEMPLATE, SPECIAL_TOKENS, TOOL_TOKENS, build_default_tokenizer)
from agentkv.model.tokenizer import IncrementalDecoder, Tokenizer, TokenizerError  # noqa: E402
from agentkv.model.tool_calls import detect_tool_call_format, parse_tool_calls  # noqa: E402

QWEN25_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA31_TEMPLATE = """\
{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
            {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Exercises the environment rather than a chat format: tojson's options, namespace,
# loop controls, the {% generation %} tag, strftime_now and extra variables.
ENVIRONMENT_TEMPLATE = """\
{%- set ns = namespace(count=0) %}
{%- for message in messages %}
    {%- if message.role == "system" %}{% continue %}{% endif %}
    {%- if ns.count >= 3 %}{% break %}{% endif %}
    {%- set ns.count = ns.count + 1 %}
    {%- generation %}{{ message.role }}: {{ message.content | tojson(indent=2, sort_keys=True) }}{% endgeneration %}
{{ message | tojson(separators=(",", ":"), ensure_ascii=True) }}
{% endfor %}
{{- tools | tojson if tools else "no tools" }}|{{ strftime_now("%Y") }}|{{ eos_token }}|{{ extra | default("-") }}
"""

LLAMA_SPECIAL = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file from the workspace.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city, in °C — or °F.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
]


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False), encoding="utf-8")


@pytest.fixture(scope="session")
def default_dir(tmp_path_factory) -> Path:
    return build_default_tokenizer(tmp_path_factory.mktemp("default_tokenizer"))


@pytest.fixture(scope="session")
def tok(default_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_dir)


@pytest.fixture(scope="session")
def qwen_dir(default_dir, tmp_path_factory) -> Path:
    # The legacy layout: template in the config, tokens in special_tokens_map.json.
    out = tmp_path_factory.mktemp("qwen25")
    (out / "tokenizer.json").write_bytes((default_dir / "tokenizer.json").read_bytes())
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": QWEN25_TEMPLATE,
        "clean_up_tokenization_spaces": False, "model_max_length": 131072})
    _write_json(out / "special_tokens_map.json", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    return out


@pytest.fixture(scope="session")
def llama_dir(default_dir, tmp_path_factory) -> Path:
    # The current layout: template in chat_template.jinja, several EOS ids in generation_config.json.
    out = tmp_path_factory.mktemp("llama31")
    backend = HFTokenizer.from_file(str(default_dir / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA_SPECIAL])
    backend.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": {"content": "<|eot_id|>", "special": True, "__type": "AddedToken"},
        "clean_up_tokenization_spaces": False, "added_tokens_decoder": {}})
    (out / "chat_template.jinja").write_text(LLAMA31_TEMPLATE, encoding="utf-8")
    eos = [backend.token_to_id(t) for t in ("<|eot_id|>", "<|eom_id|>", "<|endoftext|>")]
    _write_json(out / "generation_config.json", {"bos_token_id": backend.token_to_id("<|begin_of_text|>"), "eos_token_id": eos})
    return out


@pytest.fixture(scope="session")
def named_dir(default_dir, tmp_path_factory) -> Path:
    # Several named templates in the config: "tool_use" is taken when tools are given.
    out = tmp_path_factory.mktemp("named")
    (out / "tokenizer.json").write_bytes((default_dir / "tokenizer.json").read_bytes())
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "image_token": "<|endoftext|>",
        "chat_template": [{"name": "default", "template": ENVIRONMENT_TEMPLATE + "{{ image_token }}"},
                          {"name": "tool_use", "template": CHAT_TEMPLATE}]})
    return out


@pytest.fixture(scope="session")
def pairs(default_dir, qwen_dir, llama_dir, named_dir) -> dict:
    """Ours and the reference, loaded from the same directory."""
    dirs = {"default": default_dir, "qwen25": qwen_dir, "llama31": llama_dir, "named": named_dir}
    return {name: (Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(str(d))) for name, d in dirs.items()}


texts = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["", " ", "\n", "  padded  ", "héllo 世界 🎉", "<|im_end|>", '{"name": "x", "parameters": {}}']),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
arguments = st.dictionaries(st.text(max_size=8), json_values, max_size=3)


@st.composite
def tool_calls(draw, openai_form_only: bool = False) -> dict:
    args = draw(arguments)
    if draw(st.booleans()):  # OpenAI clients send arguments as a JSON string
        args = json.dumps(args, ensure_ascii=draw(st.booleans()))
    function = {"name": draw(st.sampled_from(["read_file", "get_weather", "run_tests"])), "arguments": args}
    if not openai_form_only and draw(st.integers(0, 3)) == 0:
        return function  # the flat form some clients use
    return {"id": "call_" + "0" * 24, "type": "function", "function": function}


@st.composite
def conversations(draw, llama: bool = False) -> list[dict]:
    """Conversations in OpenAI form; `llama` keeps to what Llama 3.1 accepts (one call
    per message, under "function") so that most examples test rendering, not raising."""
    messages = [{"role": "system", "content": draw(texts)}] if draw(st.booleans()) else []
    messages.append({"role": "user", "content": draw(texts)})
    for _ in range(draw(st.integers(0, 3))):
        calls = [draw(tool_calls(openai_form_only=llama)) for _ in range(draw(st.integers(0, 1 if llama else 2)))]
        if calls:
            messages.append({"role": "assistant", "content": draw(st.none() | texts), "tool_calls": calls})
            messages += [{"role": "tool", "tool_call_id": "call_" + "0" * 24, "content": draw(texts)} for _ in calls]
        else:
            messages.append({"role": "assistant", "content": draw(texts)})
        if draw(st.booleans()):
            messages.append({"role": "user", "content": draw(texts)})
    return messages


tool_lists = st.sampled_from([None, TOOLS, TOOLS[:1]])
reference_settings = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _assert_same_as_reference(ours: Tokenizer, reference, messages, add_generation_prompt: bool, **kwargs) -> None:
    # The defaults differ (transformers: False, ours: True), so it is always given.
    kwargs["add_generation_prompt"] = add_generation_prompt
    try:
        expected = reference.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception:
        with pytest.raises(TokenizerError):
            ours.apply_chat_template(messages, tokenize=False, **kwargs)
        return
    assert ours.apply_chat_template(messages, tokenize=False, **kwargs) == expected
    expected_ids = reference.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert ours.apply_chat_template(messages, tokenize=True, **kwargs) == expected_ids


@pytest.mark.parametrize("name", ["default", "qwen25", "llama31", "named"])
@reference_settings
@given(data=st.data(), tools=tool_lists, add_generation_prompt=st.booleans())
def test_chat_template_matches_transformers(pairs, name, data, tools, add_generation_prompt):
    ours, reference = pairs[name]
    messages = data.draw(conversations(llama=name == "llama31"))
    _assert_same_as_reference(ours, reference, messages, tools=tools, add_generation_prompt=add_generation_prompt)


FIXED_CONVERSATIONS = [
    [{"role": "user", "content": "What is in src/engine/scheduler.py?"}],
    [{"role": "system", "content": "You are a coder."},
     {"role": "user", "content": "Read the config."},
     {"role": "assistant", "content": "Reading it.", "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "config.toml"}}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": '{"ok": true}'},
     {"role": "assistant", "content": "The config is valid."},
     {"role": "user", "content": "Thanks — and the weather in Zürich?"}],
    [{"role": "user", "content": "Two files please."},
     {"role": "assistant", "content": None, "tool_calls": [
         {"type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}},
         {"type": "function", "function": {"name": "read_file", "arguments": '{"path": "b.py"}'}}]},
     {"role": "tool", "content": "print('a')"},
     {"role": "tool", "content": "print('b')"}],
]


@pytest.mark.parametrize("name", ["default", "qwen25", "llama31", "named"])
@pytest.mark.parametrize("messages", FIXED_CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_fixed_conversations_match_transformers(pairs, name, messages, tools, add_generation_prompt):
    ours, reference = pairs[name]
    _assert_same_as_reference(ours, reference, messages, tools=tools, add_generation_prompt=add_generation_prompt)


def test_template_variables_match_transformers(pairs):
    ours, reference = pairs["llama31"]
    messages = FIXED_CONVERSATIONS[1]
    for kwargs in ({"date_string": "01 Jan 2030"}, {"tools_in_user_message": False}, {"builtin_tools": ["read_file"]}):
        _assert_same_as_reference(ours, reference, messages, True, tools=TOOLS, **kwargs)
    ours, reference = pairs["named"]
    _assert_same_as_reference(ours, reference, messages, False, tools=None, extra={"ü": [1, 2]})
    _assert_same_as_reference(ours, reference, messages, False, tools=None, chat_template="tool_use")


def test_default_template_renders_hermes_tool_calls(tok):
    messages = FIXED_CONVERSATIONS[2]
    text = tok.apply_chat_template(messages, tools=TOOLS[:1], tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert '\n<tools>\n{"type": "function", "function": {"name": "read_file"' in text
    assert text.endswith(
        "<|im_start|>user\nTwo files please.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "b.py"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nprint('a')\n</tool_response>\n"
        "<tool_response>\nprint('b')\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False).endswith("</tool_response><|im_end|>\n")


def _generated_reply(tok: Tokenizer, messages: list[dict], k: int) -> str:
    """What the model wrote as message k: its turn minus the prompt before it."""
    prompt = tok.apply_chat_template(messages[:k], add_generation_prompt=True, tokenize=False)
    turn = tok.apply_chat_template(messages[:k + 1], add_generation_prompt=False, tokenize=False)
    assert turn.startswith(prompt)
    return turn[len(prompt):]


@settings(max_examples=150, deadline=None)
@given(messages=conversations(), tools=tool_lists)
def test_default_template_is_prefix_stable(tok, messages, tools):
    """Each turn's prompt plus the reply is the start of every later prompt, and the
    reply parses back into the assistant message it renders."""
    full = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=False, tokenize=False)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True, tokenize=False)
        assert full.startswith(prompt)
        reply = _generated_reply(tok, messages, k)
        assert reply.endswith("<|im_end|>\n")
        content, calls = parse_tool_calls(reply.removesuffix("<|im_end|>\n"), fmt="hermes")
        expected_calls = [call.get("function", call) for call in message.get("tool_calls", [])]
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c["name"], json.loads(c["arguments"]) if isinstance(c["arguments"], str) else c["arguments"])
            for c in expected_calls]
        expected_content = message.get("content") or ""
        assert content == (expected_content.strip() if calls else expected_content)
    for k in range(1, len(messages)):
        # Every cut except inside a run of tool results, which shares one user turn.
        if not (messages[k - 1]["role"] == "tool" and messages[k]["role"] == "tool"):
            head = tok.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=False, tokenize=False)
            assert full.startswith(head)


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_encode_adds_no_special_tokens_and_keeps_control_tokens_atomic(tok):
    assert tok.encode("") == []
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>")
    call = tok.encode("<tool_call>\n{}\n</tool_call>")
    assert call[0] == tok.token_to_id("<tool_call>") and call[-1] == tok.token_to_id("</tool_call>")
    # The tool markers are not special: a reply decoded for the user keeps them for the parser.
    assert tok.decode(ids + call, skip_special_tokens=True) == "user\nhi<tool_call>\n{}\n</tool_call>"


def test_default_tokenizer_vocabulary(tok, pairs):
    reference = pairs["default"][1]
    assert tok.vocab_size == 4096 == len(reference)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert [tok.token_to_id(t) for t in TOOL_TOKENS] == [4092, 4093, 4094, 4095]
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>")] == [reference.eos_token_id]
    assert tok.bos_token_id is None
    assert tok.token_to_id("no such token") is None
    assert detect_tool_call_format(tok.chat_template) == "hermes"


def test_special_tokens_from_every_file(pairs):
    qwen, qwen_reference = pairs["qwen25"]
    assert qwen.special_tokens == qwen_reference.special_tokens_map
    assert qwen.eos_token_ids == [qwen.token_to_id("<|im_end|>")]
    llama, llama_reference = pairs["llama31"]
    assert llama.special_tokens == llama_reference.special_tokens_map
    assert llama.bos_token_id == llama.token_to_id("<|begin_of_text|>") == llama_reference.bos_token_id
    assert llama.eos_token_ids == [llama.token_to_id(t) for t in ("<|eot_id|>", "<|eom_id|>", "<|endoftext|>")]
    assert detect_tool_call_format(llama.chat_template) == "llama3_json"
    assert detect_tool_call_format(qwen.chat_template) == "hermes"
    assert detect_tool_call_format(ENVIRONMENT_TEMPLATE) is None


def test_pretrained_tokenizer_fast_from_file_agrees(default_dir, tok):
    reference = PreTrainedTokenizerFast(tokenizer_file=str(default_dir / "tokenizer.json"), chat_template=CHAT_TEMPLATE)
    messages = FIXED_CONVERSATIONS[1]
    assert tok.apply_chat_template(messages, tools=TOOLS) == reference.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, return_dict=False)


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    decoder = IncrementalDecoder(tok, skip_special_tokens=skip_special_tokens)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_incremental_decode_equals_full_decode(tok, text):
    chunks = _stream(tok, tok.encode(text))
    assert "".join(chunks) == text
    if "\ufffd" not in text:
        # A character split across tokens is held back, never emitted as U+FFFD.
        assert not any("\ufffd" in chunk for chunk in chunks)


def test_incremental_decode_holds_back_split_characters(tok):
    text = "héllo 世界 🎉👩‍💻 ok"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "no character is split: the test tests nothing"
    chunks = _stream(tok, ids)
    assert "".join(chunks) == text and chunks[-1] == ""
    assert all("\ufffd" not in chunk for chunk in chunks)


# Single-byte tokens first: arbitrary byte sequences, including ones that never become valid UTF-8.
token_ids = st.lists(st.one_of(st.integers(3, 258), st.integers(0, 4095)), max_size=16)


@settings(max_examples=200, deadline=None)
@given(ids=token_ids, skip_special_tokens=st.booleans())
def test_incremental_decode_of_arbitrary_ids(tok, ids, skip_special_tokens):
    assert "".join(_stream(tok, ids, skip_special_tokens)) == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_errors_are_typed(tmp_path, tok, default_dir):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((default_dir / "tokenizer.json").read_bytes())
    bare = Tokenizer.from_dir(tmp_path)
    assert bare.eos_token_ids == [] and bare.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    _write_json(tmp_path / "tokenizer_config.json", {"eos_token": "<|not a token|>"})
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="empty conversation"):
        tok.apply_chat_template([])
    with pytest.raises(TokenizerError, match="unknown message role"):
        tok.apply_chat_template([{"role": "critic", "content": "no"}])
    with pytest.raises(TokenizerError, match="boom"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ raise_exception('boom') }}")
    with pytest.raises(TokenizerError, match="underscore"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% set ns = namespace(_x=1) %}")


def test_strftime_now(tok):
    rendered = tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=False,
                                       chat_template="{{ strftime_now('%Y-%m') }}")
    assert rendered == datetime.now().strftime("%Y-%m")


def test_build_is_deterministic(default_dir, tmp_path):
    """A second build, in a fresh process with another hash seed, writes the same bytes."""
    code = ("import sys; from agentkv.experiments.default_model.tokenizer import build_default_tokenizer; "
            "build_default_tokenizer(sys.argv[1])")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, cwd=root, env=env, timeout=60)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (default_dir / name).read_bytes()
