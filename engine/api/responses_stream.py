"""A response streamed as OpenAI streams Responses: typed server-sent events
(`event: <type>` and `data: <json>` with the same type and a sequence_number),
no [DONE].

The reply's text goes out as it is decoded (held back where it could still
become a tool call, as chat completions do); its message item is opened at the
first text shown. Function calls go out once the reply has ended, each as an
item with its arguments in one delta. The last event carries the whole
response: response.completed, or response.incomplete when it ran out of
max_output_tokens; an error after the stream began is one `error` event.
"""
from __future__ import annotations

import json
from typing import AsyncIterator

from pydantic import BaseModel

from engine.api.errors import from_exception
from engine.api.generation import Generation
from engine.api.replies import ReplyText
from engine.api.response_turn import Turn
from engine.api.responses_schemas import OutputFunctionCall, OutputMessage, OutputText, Response


class _Events:
    def __init__(self) -> None:
        self._sequence = 0

    def __call__(self, type: str, **fields: object) -> str:
        data = {"type": type, "sequence_number": self._sequence}
        data.update({k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in fields.items()})
        self._sequence += 1
        return f"event: {type}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def response_events(
    gen: Generation[Turn], text: ReplyText, shell: Response, message_id: str, stop_ids: list[int]
) -> AsyncIterator[str]:
    ev = _Events()
    yield ev("response.created", response=shell)
    yield ev("response.in_progress", response=shell)
    message = OutputMessage(id=message_id, status="in_progress", content=[])
    opened = False
    async for ids in gen.tokens():
        if delta := text.push(ids):
            if not opened:
                opened = True
                for event in _open_message(ev, message):
                    yield event
            yield ev("response.output_text.delta", item_id=message.id, output_index=0, content_index=0, delta=delta, logprobs=[])
    try:
        turn = await gen.result()
    except Exception as e:
        error = from_exception(e)
        yield ev("error", code=error.code, message=error.message, param=error.param)
        return
    rest, _ = text.finish(turn.token_ids, stop_ids)
    for index, item in enumerate(turn.response.output):
        if isinstance(item, OutputMessage):
            if not opened:
                for event in _open_message(ev, message):
                    yield event
            if rest:
                yield ev("response.output_text.delta", item_id=item.id, output_index=index, content_index=0, delta=rest, logprobs=[])
            part = item.content[0]
            yield ev("response.output_text.done", item_id=item.id, output_index=index, content_index=0, text=part.text, logprobs=[])
            yield ev("response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part)
        else:
            for event in _function_call(ev, item, index):
                yield event
        yield ev("response.output_item.done", output_index=index, item=item)
    yield ev(f"response.{turn.response.status}", response=turn.response)


def _open_message(ev: _Events, message: OutputMessage) -> list[str]:
    return [
        ev("response.output_item.added", output_index=0, item=message),
        ev("response.content_part.added", item_id=message.id, output_index=0, content_index=0, part=OutputText(text="")),
    ]


def _function_call(ev: _Events, item: OutputFunctionCall, index: int) -> list[str]:
    started = item.model_copy(update={"arguments": "", "status": "in_progress"})
    return [
        ev("response.output_item.added", output_index=index, item=started),
        ev("response.function_call_arguments.delta", item_id=item.id, output_index=index, delta=item.arguments),
        ev("response.function_call_arguments.done", item_id=item.id, output_index=index, name=item.name, arguments=item.arguments),
    ]
