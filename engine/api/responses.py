"""The Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items.

A response made with store (the default) keeps its session; a request naming
it as previous_response_id sends only the new items, and only their tokens are
computed (engine.api.response_turn). A response can be continued any number
of times, each continuation on a fork of its session. Unknown, deleted, unstored
(store=false) and other tenants' responses are 404s. The tenant is the API
key's (engine.api.tenants); a response's KV is in its tenant's namespace,
salted with the request's cache_salt, and a continuation must carry the
same cache_salt (400 otherwise).

A response is stored once it is complete: while it is generating, GET answers
404. An error leaves every stored response as it was.

Streaming is as OpenAI streams Responses: typed server-sent events
(`event: <type>` and `data: <json>` with the same type and a
sequence_number), no [DONE]. The reply's text goes out as it is decoded
(held back where it could still become a tool call, as chat completions
do); its message item is opened at the first text shown. Function calls go
out once the reply has ended, each as an item with its arguments in one
delta. The last event carries the whole response: response.completed, or
response.incomplete when it ran out of max_output_tokens; an error after the
stream began is one `error` event.
"""
from __future__ import annotations

import json
import secrets
from typing import Annotated, AsyncIterator, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel

from agentkv.engine import offered_tools, tool_choice_error

from agentkv.engine.api.errors import APIError, from_exception
from agentkv.engine.api.generation import Generation
from agentkv.engine.api.replies import ReplyText
from agentkv.engine.api.response_store import ResponseStore, StoredResponse
from agentkv.engine.api.response_turn import Finished, ResponseTurn, ResponseInput, new_item_id, shell
from agentkv.engine.api.responses_schemas import (
    InputItemList,
    NamedFunctionChoice,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    Response,
    ResponseDeleted,
    ResponsesRequest,
)
from agentkv.engine.api.sse import event_stream
from agentkv.engine.api.state import ApiState
from agentkv.engine.api.tenants import tenant_of

router = APIRouter(prefix="/v1/responses")


def _api(request: Request) -> ApiState:
    return request.app.state.api


def _store(request: Request) -> ResponseStore:
    return _api(request).responses


def _entry(request: Request, response_id: str) -> StoredResponse:
    return _store(request).get(response_id, tenant_of(request).name)


def check_tool_choice(body: ResponsesRequest) -> None:
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunctionChoice) else body.tool_choice
    if (why := tool_choice_error(choice, [tool.name for tool in body.tools or ()])) is not None:
        raise APIError(400, why, param="tool_choice")


@router.post("", response_model=None)
async def create_response(body: ResponsesRequest, request: Request):
    api, store, tenant = _api(request), _store(request), tenant_of(request)
    api.check_model(body.model)
    api.check_supported(body.unsupported())
    check_tool_choice(body)
    api.check_kv_quota(tenant)
    namespace = tenant.namespace(body.cache_salt)
    previous = store.get(body.previous_response_id, tenant.name) if body.previous_response_id else None
    if previous is not None and previous.session.namespace != namespace:
        raise APIError(400, f"response {previous.id!r} was made with another cache_salt", param="cache_salt")
    response_id = "resp_" + secrets.token_hex(16)
    turn = ResponseInput(body, body.items(), tenant.name, namespace, previous, shell(body, response_id),
                       new_item_id("message"))
    text = ReplyText(api.tokenizer, (), api.tool_format if offered_tools(turn.tools, turn.tool_choice) else None)
    gen = await Generation.begin(lambda on_tokens, on_done: ResponseTurn.begin(api, store, turn, on_tokens, on_done))
    if not body.stream:
        return (await gen.result_unless_gone(request)).response
    await gen.started(request)
    return event_stream(_events(gen, text, turn.shell, turn.message_id), gen.abandon)


@router.get("/{response_id}")
def read_response(request: Request, response_id: str) -> Response:
    return _entry(request, response_id).response


@router.delete("/{response_id}")
def delete_response(request: Request, response_id: str) -> ResponseDeleted:
    _store(request).delete(response_id, tenant_of(request).name)
    return ResponseDeleted(id=response_id)


@router.get("/{response_id}/input_items")
def list_input_items(
    request: Request,
    response_id: str,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> InputItemList:
    items = _entry(request, response_id).input_items
    items = items[::-1] if order == "desc" else items
    ids = [item["id"] for item in items]
    if after is not None and after not in ids:
        raise APIError(400, f"no input item {after!r} in response {response_id!r}", param="after")
    start = ids.index(after) + 1 if after is not None else 0
    page = items[start : start + limit]
    return InputItemList(
        data=page, first_id=page[0]["id"] if page else None, last_id=page[-1]["id"] if page else None,
        has_more=start + limit < len(items),
    )


class _SequencedEvents:
    def __init__(self) -> None:
        self._sequence = 0

    def __call__(self, type: str, **fields: object) -> str:
        data = {"type": type, "sequence_number": self._sequence}
        data.update({k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in fields.items()})
        self._sequence += 1
        return f"event: {type}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(
    gen: Generation[Finished], text: ReplyText, shell: Response, message_id: str
) -> AsyncIterator[str]:
    ev = _SequencedEvents()
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
    rest, _ = text.finish(turn.result)
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


def _open_message(ev: _SequencedEvents, message: OutputMessage) -> list[str]:
    return [
        ev("response.output_item.added", output_index=0, item=message),
        ev("response.content_part.added", item_id=message.id, output_index=0, content_index=0, part=OutputText(text="")),
    ]


def _function_call(ev: _SequencedEvents, item: OutputFunctionCall, index: int) -> list[str]:
    started = item.model_copy(update={"arguments": "", "status": "in_progress"})
    return [
        ev("response.output_item.added", output_index=index, item=started),
        ev("response.function_call_arguments.delta", item_id=item.id, output_index=index, delta=item.arguments),
        ev("response.function_call_arguments.done", item_id=item.id, output_index=index, name=item.name, arguments=item.arguments),
    ]
