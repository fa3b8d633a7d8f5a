"""A finished turn as the Messages API's reply: its text (if any) as a text
block, then each tool call as a tool_use block with its parsed input; the
stop reason from how the turn ended (tool calls, the max_tokens budget, a
stop sequence, which it names, or the model's own end)."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from agentkv.engine import Tokenizer, TurnResult, first_stop
from agentkv.engine.api.messages_schemas import Content, Message, MessagesUsage, StopReason, TextContent, ToolUseContent


@dataclass(frozen=True)
class Stop:
    reason: StopReason
    sequence: str | None = None


def stop_of(result: TurnResult, stops: tuple[str, ...], tokenizer: Tokenizer) -> Stop:
    if result.tool_calls:
        return Stop("tool_use")
    if result.finish_reason == "length":
        return Stop("max_tokens")
    if stops:
        # The turn's text is cut before the stop: find it in the whole reply.
        text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        at = first_stop(text, stops)
        if at is not None:
            return Stop("stop_sequence", next(s for s in stops if text.startswith(s, at)))
    return Stop("end_turn")


def tool_uses(result: TurnResult) -> list[ToolUseContent]:
    return [ToolUseContent(id=call["id"], name=call["name"], input=call["arguments"]) for call in result.tool_calls]


def content_of(result: TurnResult) -> list[Content]:
    text: list[Content] = [TextContent(text=result.text)] if result.text else []
    return text + tool_uses(result)


@dataclass(frozen=True)
class MessageMeta:
    model: str
    id: str = field(default_factory=lambda: "msg_" + secrets.token_hex(12))

    def message(self, content: list[Content], stop: Stop | None, usage: MessagesUsage) -> Message:
        return Message(id=self.id, model=self.model, content=content, stop_reason=stop.reason if stop else None,
                       stop_sequence=stop.sequence if stop else None, usage=usage)
