"""Mistral's `[TOOL_CALLS]` formats.

- mistral (tokenizer v3: Mistral 7B v0.3, Nemo): one JSON list of calls,
  `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, after any text.
- mistral_v11 (tokenizer v11+: Mistral Small 3.2, Magistral, Devstral): each
  call is `[TOOL_CALLS]name[ARGS]{...}`, one after another.

Their templates refuse tool-call ids that are not 9 alphanumeric characters,
so calls read in these formats get such ids.
"""
from __future__ import annotations

import json
import re

from agentkv.model.tool_formats.base import DECODER, ToolCallFormat, json_call_list, short_call_id

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[\w.-]+")


def read_v3(text: str) -> tuple[str, list[dict]]:
    at = text.find(MARKER)
    if at < 0:
        # The marker is a special token in Mistral's vocabularies, which decoding
        # may drop: a reply that is a JSON list of call objects still is calls.
        body = text.lstrip()
        calls = json_call_list(text, len(text) - len(body), require_arguments=True) if body.startswith("[") else None
        return ("", calls) if calls else (text, [])
    rest = text[at + len(MARKER):]
    calls = json_call_list(text, len(text) - len(rest.lstrip()))
    return (text[:at].strip(), calls) if calls else (text, [])


def _v11_call(piece: str) -> tuple[dict, str] | None:
    """The call a piece after a marker holds, and the text after its arguments."""
    name, sep, arguments = piece.partition(ARGS)
    name, arguments = name.strip(), arguments.lstrip()
    if not sep or not _NAME.fullmatch(name):
        return None
    try:
        obj, end = DECODER.raw_decode(arguments)
    except json.JSONDecodeError:
        return None
    return ({"name": name, "arguments": obj}, arguments[end:]) if isinstance(obj, dict) else None


def read_v11(text: str) -> tuple[str, list[dict]]:
    # Each call ends with its JSON, and text may follow it (as a grammar under
    # tool_choice "auto" allows); any malformed call leaves the whole reply text.
    head, *pieces = text.split(MARKER)
    read = [_v11_call(piece) for piece in pieces]
    if not read or None in read:
        return text, []
    kept = [head] + [rest for _, rest in read]
    return "\n".join(piece.strip() for piece in kept if piece.strip()), [call for call, _ in read]


MISTRAL = ToolCallFormat("mistral", MARKER, '{{"name": {name}, "arguments": ', "}", ", ", MARKER, "[", read_v3,
                         list_open=MARKER + " [", list_close="]", mapping_arguments=True, special_markers=(MARKER,),
                         new_id=short_call_id)
MISTRAL_V11 = ToolCallFormat("mistral_v11", MARKER, MARKER + "{name}" + ARGS, "", "", MARKER, "", read_v11,
                             quoted_name=False, special_markers=(MARKER, ARGS), new_id=short_call_id)
