"""Llama 3.1/3.2 JSON: the whole reply is `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several calls separated by `;`."""
from __future__ import annotations

import json

from agentkv.model.tool_formats.base import DECODER, ToolCallFormat, as_call

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


def read(text: str) -> tuple[str, list[dict]]:
    body = text.strip().removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return text, []
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, pos = DECODER.raw_decode(body, pos)
        except json.JSONDecodeError:
            return text, []
        # Without markers, only an object shaped like a call is one: a reply that
        # is JSON for the user ({"name": "Ada"}) must stay text.
        call = as_call(obj, require_arguments=True)
        if call is None:
            return text, []
        calls.append(call)
        while pos < len(body) and body[pos] in _SEPARATORS:
            pos += 1
    return "", calls


LLAMA3_JSON = ToolCallFormat("llama3_json", PYTHON_TAG, '{{"name": {name}, "parameters": ', "}", "; ", '{"name": ',
                             "{", read)
