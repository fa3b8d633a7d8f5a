"""Tool calls in a model's reply, in the formats chat templates teach (one
module each under model.tool_formats):

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among text;
- llama3_json: the reply is `{"name": ..., "parameters": {...}}`, calls separated by `;`;
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`;
- mistral_v11: `[TOOL_CALLS]name[ARGS]{...}`, repeated;
- pythonic: the reply is `[get_weather(city="Paris"), now()]`;
- phi4_mini: `functools[{"name": ..., "arguments": {...}}, ...]`.

A reply is text the model wrote, so nothing here raises: what does not parse
as a call stays in the text. The tokenizer knows its template's format
(Tokenizer.tool_call_format), and every reader of a reply parses with that
one. tool_choice_error is the one check of a tool_choice against the tools
offered.
"""
from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from agentkv.model.tool_formats.base import ToolCallFormat, new_call_id
from agentkv.model.tool_formats.hermes import HERMES, OPEN as _HERMES_OPEN
from agentkv.model.tool_formats.llama3_json import LLAMA3_JSON, PYTHON_TAG
from agentkv.model.tool_formats.mistral import ARGS, MARKER as _MISTRAL_MARKER, MISTRAL, MISTRAL_V11
from agentkv.model.tool_formats.phi4_mini import PHI4_MINI
from agentkv.model.tool_formats.pythonic import PYTHONIC

__all__ = ["ToolCallFormat", "TOOL_CALL_FORMATS", "format_of_template", "tool_choice_error", "parse_tool_calls",
           "detect_tool_call_format", "new_call_id"]

TOOL_CALL_FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_V11, PYTHONIC, PHI4_MINI)}
FORMATS = tuple(TOOL_CALL_FORMATS)
# The example call the pythonic templates (Llama 3.2/4's, Gemma 3's) show the model.
_PYTHONIC_EXAMPLE = re.compile(r"\[func_name1\(param")


def parse_tool_calls(text: str, fmt: str | None = None) -> tuple[str, list[dict]]:
    """Split a reply into its text and its tool calls.

    Returns (text outside the calls, [{"id": ..., "name", "arguments": dict}]).
    `fmt` is one of FORMATS (see detect_tool_call_format); None tries hermes, then llama3_json.
    """
    if fmt is not None and fmt not in TOOL_CALL_FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}; expected one of {FORMATS}")
    if fmt is not None:
        return TOOL_CALL_FORMATS[fmt].parse(text)
    content, calls = HERMES.parse(text)
    return (content, calls) if calls else LLAMA3_JSON.parse(text)


def detect_tool_call_format(chat_template: str | None) -> str | None:
    """The format a chat template teaches its model to call tools in, if any:
    read from the template's text, never guessed from a reply."""
    if not chat_template:
        return None
    if _HERMES_OPEN in chat_template:
        return "hermes"
    if _MISTRAL_MARKER in chat_template:
        return "mistral_v11" if ARGS in chat_template else "mistral"
    if "functools[" in chat_template:
        return "phi4_mini"
    if _PYTHONIC_EXAMPLE.search(chat_template):
        return "pythonic"
    if PYTHON_TAG in chat_template or ("<|start_header_id|>" in chat_template and '"parameters"' in chat_template):
        return "llama3_json"
    return None


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
