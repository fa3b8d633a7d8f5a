"""From a reply's token ids to what the client sees, as they arrive: the
turn (engine.turn) cuts the whole reply before its first stop string (OpenAI
never returns the stop sequence; the engine keeps the token that completed
it in the session) and parses its tool calls once; this shows the text as
it streams, consistent with that.

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

from agentkv.engine import IncrementalDecoder, Tokenizer, ToolCallFormat, TurnResult, first_stop
from agentkv.engine.api.schemas import ResponseFunctionCall, ResponseToolCall, Usage

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


def reply_of(result: TurnResult) -> Reply:
    """The turn's reply as OpenAI's APIs give it (no content beside tool calls is null)."""
    calls = result.tool_calls
    return Reply(result.text if result.text or not calls else None, to_openai_calls(calls), result.finish_reason)


def usage_of(result: TurnResult) -> Usage:
    u = result.usage
    return Usage.of(u["prompt_tokens"], u["completion_tokens"], u["cached_tokens"])


class ReplyText:
    """A reply's text as its tokens arrive. `tool_format` None means tool
    calls are not parsed (no tools offered, or tool_choice "none")."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...], tool_format: ToolCallFormat | None):
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens=True,
                                           keep=tokenizer.tool_markers if tool_format else None)
        self._stops = stops
        self._tool_format = tool_format
        self._barriers = stops + ((tool_format.marker,) if tool_format and tool_format.marker else ())
        self._longest = max(map(len, self._barriers), default=0)
        self._text = ""  # everything decoded so far
        self._shown = 0  # characters of text given out
        self._ended = False  # a barrier was reached: nothing more is shown

    def push(self, ids: list[int]) -> str:
        """The text it is now safe to show."""
        self._text += "".join(self._decoder.push(i) for i in ids)
        return self._advance(final=False)

    def finish(self, result: TurnResult) -> tuple[str, Reply]:
        """Once every token is pushed: the rest of the text to show, and the
        whole reply as the turn parsed it."""
        self._text += self._decoder.flush()
        content, calls = result.text, result.tool_calls
        # Held back for fear of a call: now shown if there was none.
        rest = "" if calls else self._advance(final=True)
        # What the tool-call parser keeps after the calls was never shown.
        shown = self._text[: self._shown]
        if content.startswith(shown):
            rest += content[len(shown) :]
        return rest, reply_of(result)

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
        unmarked = self._tool_format.unmarked if self._tool_format else ""
        if unmarked and not self._shown and _FIRST_CHAR.match(tail).group(1) in ("", unmarked):
            return len(tail)  # a reply that is calls may have no marker: hold it all until the end
        held = next(
            (n for n in range(min(len(tail), self._longest - 1), 0, -1) if any(b.startswith(tail[-n:]) for b in self._barriers)),
            0,
        )
        if self._tool_format:
            # Whitespace before a possible tool call may be stripped by the parser.
            held = len(tail) - len(tail[: len(tail) - held].rstrip())
        return held
