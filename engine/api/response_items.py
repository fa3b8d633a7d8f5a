"""Responses API items as the chat messages a chat template renders.

The conversion is what chat completions would be sent for the same
conversation: user and system messages as they are (developer as system),
each function_call joined to the assistant message just before it in the same
input (or a message of its own), each function_call_output a tool message.
A response's reply (its text and its calls) is one assistant message.
"""
from __future__ import annotations

import secrets
from typing import Iterable

from engine.api.errors import APIError
from engine.api.responses_schemas import FunctionCallItem, FunctionCallOutputItem, MessageItem
from engine.api.schemas import (
    AssistantMessage,
    FunctionCall,
    Message,
    ResponseToolCall,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
    template_message,
)

Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


def new_item_id(item_type: str) -> str:
    return _ID_PREFIX[item_type] + secrets.token_hex(12)


def system_message(text: str) -> dict:
    return template_message(SystemMessage(role="system", content=text))


def call_ids(messages: Iterable[dict]) -> set[str]:
    return {call["id"] for m in messages for call in m.get("tool_calls", ())}


def to_messages(items: list[Item], known_calls: set[str]) -> list[dict]:
    """The items as chat messages; 400 for an output of a call that no
    function_call before it (here or earlier in the conversation) made."""
    messages: list[Message] = []
    known = set(known_calls)
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append(_message(item))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if isinstance(last, AssistantMessage):
                last.tool_calls = [*(last.tool_calls or ()), call]
            else:
                messages.append(AssistantMessage(role="assistant", tool_calls=[call]))
            known.add(item.call_id)
        else:
            if item.call_id not in known:
                raise APIError(400, f"input[{i}] is the output of call {item.call_id!r}, but no function_call made it",
                               code="invalid_call_id", param=f"input.{i}.call_id")
            messages.append(ToolMessage(role="tool", content=item.output, tool_call_id=item.call_id))
    return [template_message(m) for m in messages]


def _message(item: MessageItem) -> Message:
    if item.role == "user":
        return UserMessage(role="user", content=item.text())
    if item.role == "assistant":
        return AssistantMessage(role="assistant", content=item.text())
    return SystemMessage(role=item.role, content=item.text())


def reply_message(content: str | None, calls: list[ResponseToolCall]) -> dict:
    tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.function.name, arguments=c.function.arguments)) for c in calls]
    return template_message(AssistantMessage(role="assistant", content=content, tool_calls=tool_calls or None))


def listed(items: list[Item]) -> list[dict]:
    """The items as input_items lists them: each with an id."""
    return [{"id": item.id or new_item_id(item.type), **item.model_dump(exclude_none=True, exclude={"id"})} for item in items]
