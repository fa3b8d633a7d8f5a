"""From a reply's token ids to what the client sees: text cut before the first
stop string (OpenAI never returns the stop sequence; the engine keeps the
token that completed it in the session), tool calls split out of the text,
and the finish reason.

Streaming shows the same text as it arrives. What it has shown must never be
taken back, so it holds back any tail that could still grow into a stop
string or a tool-call marker, and shows nothing past one. With no tool calls
the streamed deltas add up to exactly the non-streamed content; with tool
calls the stream shows the text before the first call, then whatever the
parser keeps after it (the parser also strips whitespace around the calls, so
leading whitespace before a call may differ).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from agentkv.engine.api.schemas import ResponseFunctionCall, ResponseToolCall
from agentkv.engine.stops import cut_at_stop, first_stop
from agentkv.model.tokenizer import IncrementalDecoder, Tokenizer
from agentkv.model.tool_calls import ToolCallFormat

_FIRST_CHAR = re.compile(r"\s*(\S?)")


@dataclass
class Reply:
    content: str | None
    tool_calls: list[ResponseToolCall]
    finish_reason: str


def to_openai_calls(calls: list[dict]) -> list[ResponseToolCall]:
    return [
        ResponseToolCall(
            id=call["id"],
            function=ResponseFunctionCall(name=call["name"], arguments=json.dumps(call["arguments"], ensure_ascii=False)),
        )
        for call in calls
    ]


def finish_reason(ids: list[int], stop_ids: list[int], stopped_by_string: bool, has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    return "stop" if stopped_by_string or (ids and ids[-1] in stop_ids) else "length"


class ReplyText:
    """A reply's text as its tokens arrive. `tool_format` None means tool
    calls are not parsed (no tools offered, or tool_choice "none")."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...], tool_format: ToolCallFormat | None):
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens=True)
        self._stops = stops
        self._tool_format = tool_format
        self._barriers = stops + ((tool_format.marker,) if tool_format else ())
        self._longest = max(map(len, self._barriers), default=0)
        self._text = ""  # everything decoded so far
        self._shown = 0  # characters of text given out
        self._ended = False  # a barrier was reached: nothing more is shown

    def push(self, ids: list[int]) -> str:
        """The text it is now safe to show."""
        self._text += "".join(self._decoder.push(i) for i in ids)
        return self._advance(final=False)

    def finish(self, ids: list[int], stop_ids: list[int]) -> tuple[str, Reply]:
        """Once every token is pushed: the rest of the text to show, and the whole reply."""
        self._text += self._decoder.flush()
        text, stopped = cut_at_stop(self._text, self._stops)
        content, calls = self._tool_format.parse(text) if self._tool_format else (text, [])
        # Held back for fear of a call: now shown if there was none.
        rest = "" if calls else self._advance(final=True)
        # What the tool-call parser keeps after the calls was never shown.
        shown = self._text[: self._shown]
        if content.startswith(shown):
            rest += content[len(shown) :]
        reason = finish_reason(ids, stop_ids, stopped, bool(calls))
        return rest, Reply(content if content or not calls else None, to_openai_calls(calls), reason)

    def _advance(self, final: bool) -> str:
        if self._ended:
            return ""
        # Text before shown - longest was searched already, on earlier pushes.
        start = max(0, self._shown - self._longest)
        end = first_stop(self._text, self._barriers, start)
        if end is not None:
            self._ended = True
            if self._tool_format and not self._text.startswith(self._stops, end):
                end = len(self._text[:end].rstrip())  # the parser strips the text before a call
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._held_back()
        delta, self._shown = self._text[self._shown : end], end
        return delta

    def _held_back(self) -> int:
        """How many trailing characters could still become part of a barrier."""
        tail = self._text[self._shown :]
        # Shown text never ends in held-back whitespace, so nothing shown means nothing but whitespace came yet.
        unmarked = self._tool_format is not None and self._tool_format.unmarked
        if unmarked and not self._shown and _FIRST_CHAR.match(tail).group(1) in ("", "{"):
            return len(tail)  # a reply that is a JSON call has no marker: hold it all until the end
        held = next(
            (n for n in range(min(len(tail), self._longest - 1), 0, -1) if any(b.startswith(tail[-n:]) for b in self._barriers)),
            0,
        )
        if self._tool_format:
            # Whitespace before a possible tool call may be stripped by the parser.
            held = len(tail) - len(tail[: len(tail) - held].rstrip())
        return held
