"""Phi-4-mini: `functools[{"name": ..., "arguments": {...}}, ...]`, after any text."""
from __future__ import annotations

from agentkv.model.tool_formats.base import ToolCallFormat, json_call_list

MARKER = "functools"


def read(text: str) -> tuple[str, list[dict]]:
    at = text.find(MARKER + "[")
    calls = json_call_list(text, at + len(MARKER)) if at >= 0 else None
    return (text[:at].strip(), calls) if calls else (text, [])


PHI4_MINI = ToolCallFormat("phi4_mini", MARKER, '{{"name": {name}, "arguments": ', "}", ", ", MARKER + "[", "",
                           read, list_open=MARKER + "[", list_close="]")
