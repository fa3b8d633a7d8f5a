"""Tool calls in a model's reply, in the two formats chat templates teach.

- hermes (Hermes, Qwen2.5, the embedded default): any number of
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among text.
- llama3_json (Llama 3.1/3.2): the whole reply is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, several calls separated by `;`.

A reply is text the model wrote, so nothing here raises: what does not parse
as a call stays in the text.

A ToolCallFormat is all one format says: what a call looks like to a grammar
(engine.structured), the marker that starts one in a reply (streaming shows
no text past it: engine.api.replies) and how to read the calls back; the
tokenizer knows its template's (Tokenizer.tool_call_format), and every
reader of a reply parses with that one. tool_choice_error is the one check
of a tool_choice against the tools offered.
"""
from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

__all__ = ["ToolCallFormat", "TOOL_CALL_FORMATS", "format_of_template", "tool_choice_error", "parse_tool_calls",
           "detect_tool_call_format", "new_call_id"]

FORMATS = ("hermes", "llama3_json")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_SPACE = re.compile(r"\s*")
_PYTHON_TAG = "<|python_tag|>"
_LLAMA3_SEPARATORS = " \t\r\n;"
# Raw control characters (a tab) inside strings are not JSON, but they are
# unambiguous, models write them, and grammars over length-bounded strings
# admit them: read such a call rather than lose it.
_DECODER = json.JSONDecoder(strict=False)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _as_call(obj: Any, require_arguments: bool) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    if require_arguments and key not in obj:
        return None
    arguments = obj.get(key, {})
    if isinstance(arguments, str):
        try:
            arguments = _DECODER.decode(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": new_call_id(), "name": obj["name"], "arguments": arguments}


def _hermes_block(text: str, start: int) -> tuple[dict | None, int]:
    """The call in the block opened at start, and where the block ends. The
    JSON is read first, so a closing tag inside one of its strings is data.
    An unclosed block at the very end still counts: generation often stops
    on the closing tag or on EOS right before it."""
    try:
        obj, end = _DECODER.raw_decode(text, _SPACE.match(text, start + len(_HERMES_OPEN)).end())
    except json.JSONDecodeError:
        return None, start
    end = _SPACE.match(text, end).end()
    if text.startswith(_HERMES_CLOSE, end):
        end += len(_HERMES_CLOSE)
    elif end < len(text):
        return None, start
    return _as_call(obj, require_arguments=False), end


def _parse_hermes(text: str) -> tuple[str, list[dict]]:
    calls, kept, pos = [], [], 0
    start = text.find(_HERMES_OPEN)
    while start >= 0:
        call, end = _hermes_block(text, start)
        if call is not None:
            kept.append(text[pos:start])
            pos = end
            calls.append(call)
        start = text.find(_HERMES_OPEN, max(end, start + 1))
    if not calls:
        return text, []
    kept.append(text[pos:])
    # The newlines that framed each block go with it.
    return "\n".join(piece.strip() for piece in kept if piece.strip()), calls


def _parse_llama3_json(text: str) -> tuple[str, list[dict]]:
    body = text.strip().removeprefix(_PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, pos = _DECODER, [], 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return text, []
        # Without markers, only an object shaped like a call is one: a reply that
        # is JSON for the user ({"name": "Ada"}) must stay text.
        call = _as_call(obj, require_arguments=True)
        if call is None:
            return text, []
        calls.append(call)
        while pos < len(body) and body[pos] in _LLAMA3_SEPARATORS:
            pos += 1
    return "", calls


def parse_tool_calls(text: str, fmt: str | None = None) -> tuple[str, list[dict]]:
    """Split a reply into its text and its tool calls.

    Returns (text outside the calls, [{"id": "call_<24 hex>", "name", "arguments": dict}]).
    `fmt` is "hermes" or "llama3_json" (see detect_tool_call_format); None tries both.
    """
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}; expected one of {FORMATS}")
    if fmt in (None, "hermes"):
        content, calls = _parse_hermes(text)
        if calls or fmt == "hermes":
            return content, calls
    return _parse_llama3_json(text)


def detect_tool_call_format(chat_template: str | None) -> str | None:
    """The format a chat template teaches its model to call tools in, if any."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if _PYTHON_TAG in chat_template or ("<|start_header_id|>" in chat_template and '"parameters"' in chat_template):
        return "llama3_json"
    return None


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    marker: str  # what starts a call in a reply
    call_begin: str  # a call up to its arguments; {name} is the tool's name as a JSON string
    call_end: str  # after the arguments
    separator: str  # between parallel calls
    trigger: str  # what, once written, holds the rest of the reply to a call (tool_choice "auto")
    unmarked: bool  # a reply may also be calls with no marker at all: JSON from its first character

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """parse_tool_calls in this format alone."""
        return parse_tool_calls(text, self.name)


TOOL_CALL_FORMATS = {
    "hermes": ToolCallFormat("hermes", _HERMES_OPEN, _HERMES_OPEN + '\n{{"name": {name}, "arguments": ',
                             "}\n" + _HERMES_CLOSE, "\n", _HERMES_OPEN, False),
    "llama3_json": ToolCallFormat("llama3_json", _PYTHON_TAG, '{{"name": {name}, "parameters": ', "}", "; ",
                                  '{"name": ', True),
}


def format_of_template(chat_template: str | None) -> ToolCallFormat:
    """The format a chat template teaches; Hermes where it says none."""
    return TOOL_CALL_FORMATS[detect_tool_call_format(chat_template) or "hermes"]


def chosen_tool_name(tool_choice: Any) -> str | None:
    """The function a tool_choice names: chat's {"type": "function",
    "function": {"name": ...}} or the Responses API's {"type": "function",
    "name": ...}; None for anything else."""
    if not isinstance(tool_choice, dict):
        return None
    name = tool_choice.get("function", tool_choice).get("name")
    return name if isinstance(name, str) else None


def tool_choice_error(tool_choice: Any, offered: Collection[str]) -> str | None:
    """Why tool_choice cannot be met with the tools named offered, or None."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return None if offered else 'tool_choice "required" needs tools'
    name = chosen_tool_name(tool_choice)
    if name is None:
        return f'tool_choice must be "none", "auto", "required" or a named function, got {tool_choice!r}'
    return None if name in offered else f"tool_choice names {name!r}, which is not among the tools"
