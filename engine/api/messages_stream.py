"""A Messages API reply streamed as Anthropic streams it: typed server-sent
events (`event: <type>` and `data: <json>` of the same type).

message_start (the message, no content yet, its usage giving the prompt's
length), ping, then the text block as it is decoded (content_block_start,
content_block_delta text_delta per step, content_block_stop; held back
where it could still become a tool call or a stop sequence, as chat
completions do: engine.api.replies), opened at the first text shown. Tool
calls go out once the reply has ended, each a tool_use block whose whole
input is one input_json_delta. Then message_delta (the stop reason and the
whole usage, as the engine counted it), message_stop. An error after the
stream began is one `error` event.
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Callable

from pydantic import BaseModel

from agentkv.engine import TurnResult
from agentkv.engine.api.generation import Generation
from agentkv.engine.api.messages_errors import error_event
from agentkv.engine.api.messages_reply import MessageMeta, Stop, tool_uses
from agentkv.engine.api.messages_schemas import CacheCreation, MessagesUsage, TextContent
from agentkv.engine.api.replies import ReplyText


def sse(type: str, **fields: object) -> str:
    data = {"type": type, **{k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in fields.items()}}
    return f"event: {type}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def events(gen: Generation[TurnResult], text: ReplyText, meta: MessageMeta, prompt_tokens: int,
                 finish: Callable[[TurnResult], tuple[Stop, MessagesUsage]]) -> AsyncIterator[str]:
    """finish: the stop and usage of the finished turn."""
    # How much of the prompt was found cached is known once the turn ends: message_delta says.
    announced = MessagesUsage(input_tokens=prompt_tokens, output_tokens=0, cache_read_input_tokens=0,
                              cache_creation_input_tokens=0, cache_creation=CacheCreation())
    yield sse("message_start", message=meta.message([], None, announced))
    yield sse("ping")
    opened = False

    def show(delta: str) -> list[str]:
        nonlocal opened
        opening = [] if opened else [sse("content_block_start", index=0, content_block=TextContent(text=""))]
        opened = True
        return opening + [sse("content_block_delta", index=0, delta={"type": "text_delta", "text": delta})]

    async for ids in gen.tokens():
        if delta := text.push(ids):
            for event in show(delta):
                yield event
    try:
        result = await gen.result()
    except Exception as e:
        yield error_event(e)
        return
    rest, _ = text.finish(result)
    for event in show(rest) if rest else ():
        yield event
    if opened:
        yield sse("content_block_stop", index=0)
    for index, use in enumerate(tool_uses(result), int(opened)):
        yield sse("content_block_start", index=index, content_block=use.model_copy(update={"input": {}}))
        yield sse("content_block_delta", index=index,
                  delta={"type": "input_json_delta", "partial_json": json.dumps(use.input, ensure_ascii=False)})
        yield sse("content_block_stop", index=index)
    stop, usage = finish(result)
    yield sse("message_delta", delta={"stop_reason": stop.reason, "stop_sequence": stop.sequence}, usage=usage)
    yield sse("message_stop")
