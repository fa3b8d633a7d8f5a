"""What every tool-call format shares: the ToolCallFormat record and the
reading of one call object out of JSON."""
from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Raw control characters (a tab) inside strings are not JSON, but they are
# unambiguous, models write them, and grammars over length-bounded strings
# admit them: read such a call rather than lose it.
DECODER = json.JSONDecoder(strict=False)
_ALNUM = string.ascii_letters + string.digits

Reader = Callable[[str], tuple[str, list[dict]]]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def short_call_id() -> str:
    """Mistral's templates refuse ids that are not 9 alphanumeric characters."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class ToolCallFormat:
    """All one format says: what a call looks like to a grammar
    (engine.structured), the marker that starts one in a reply (streaming
    shows no text past it: engine.api.replies) and how to read calls back."""

    name: str
    marker: str  # what starts a call in a reply; "" for a format with none (the reply is the calls)
    call_begin: str  # a call up to its arguments; {name} is the tool's name (JSON-quoted if quoted_name)
    call_end: str  # after the arguments
    separator: str  # between parallel calls
    trigger: str  # what, once written, holds the rest of the reply to calls (tool_choice "auto")
    unmarked: str  # the first character of a reply that is calls with no marker; "" where there is none
    reader: Reader
    list_open: str = ""  # the calls sit in one list: what opens it (marker included), and closes it
    list_close: str = ""
    quoted_name: bool = True
    python_arguments: bool = False  # arguments are Python keyword arguments, not a JSON object
    # Its templates read a call's arguments as a mapping (iterate it, tojson the
    # whole call), where OpenAI clients send a JSON string: the tokenizer gives them the mapping.
    mapping_arguments: bool = False
    # Its markup that vocabularies hold as special tokens (Mistral's [TOOL_CALLS]):
    # kept in a reply's text, where its calls are read, and writable under a grammar.
    special_markers: tuple[str, ...] = ()
    new_id: Callable[[], str] = new_call_id

    def begin(self, tool: str) -> str:
        """call_begin for one tool."""
        return self.call_begin.format(name=json.dumps(tool) if self.quoted_name else tool)

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """(text outside the calls, [{"id", "name", "arguments": dict}]); never raises."""
        content, calls = self.reader(text)
        for call in calls:
            call["id"] = self.new_id()
        return content, calls


def as_call(obj: Any, require_arguments: bool) -> dict | None:
    """{"name", "arguments": dict} from a call object ("arguments" or
    "parameters", a JSON string or an object); None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    if require_arguments and key not in obj:
        return None
    arguments = obj.get(key, {})
    if isinstance(arguments, str):
        try:
            arguments = DECODER.decode(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": obj["name"], "arguments": arguments}


def json_call_list(text: str, start: int, require_arguments: bool = False) -> list[dict] | None:
    """The calls of a JSON list (or a lone object) of call objects that
    starts at `start` and runs, but for whitespace, to the end of text; None
    if that is not what is there."""
    try:
        obj, end = DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        return None
    if text[end:].strip():
        return None
    objs = obj if isinstance(obj, list) else [obj]
    calls = [as_call(o, require_arguments) for o in objs]
    return calls if calls and None not in calls else None
