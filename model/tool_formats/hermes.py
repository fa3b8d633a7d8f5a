"""Hermes (Hermes, Qwen2.5, the embedded default): any number of
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among text."""
from __future__ import annotations

import json
import re

from agentkv.model.tool_formats.base import DECODER, ToolCallFormat, as_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_SPACE = re.compile(r"\s*")


def _block(text: str, start: int) -> tuple[dict | None, int]:
    """The call in the block opened at start, and where the block ends. The
    JSON is read first, so a closing tag inside one of its strings is data.
    An unclosed block at the very end still counts: generation often stops
    on the closing tag or on EOS right before it."""
    try:
        obj, end = DECODER.raw_decode(text, _SPACE.match(text, start + len(OPEN)).end())
    except json.JSONDecodeError:
        return None, start
    end = _SPACE.match(text, end).end()
    if text.startswith(CLOSE, end):
        end += len(CLOSE)
    elif end < len(text):
        return None, start
    return as_call(obj, require_arguments=False), end


def read(text: str) -> tuple[str, list[dict]]:
    calls, kept, pos = [], [], 0
    start = text.find(OPEN)
    while start >= 0:
        call, end = _block(text, start)
        if call is not None:
            kept.append(text[pos:start])
            pos = end
            calls.append(call)
        start = text.find(OPEN, max(end, start + 1))
    if not calls:
        return text, []
    kept.append(text[pos:])
    # The newlines that framed each block go with it.
    return "\n".join(piece.strip() for piece in kept if piece.strip()), calls


HERMES = ToolCallFormat("hermes", OPEN, OPEN + '\n{{"name": {name}, "arguments": ', "}\n" + CLOSE, "\n", OPEN, "",
                        read)
