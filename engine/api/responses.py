"""The Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items.

A response made with store (the default) keeps its session; a request naming
it as previous_response_id sends only the new items, and only their tokens are
computed (see response_turn). A response can be continued any number of times,
each continuation on a fork of its session. Unknown, deleted, unstored
(store=false) and other tenants' responses are 404s. The tenant is the API
key's (engine.api.tenants); a response's KV is in its tenant's namespace,
salted with the request's cache_salt, and a continuation must carry the
same cache_salt (400 otherwise).

A response is stored once it is complete: while it is generating, GET answers
404. An error leaves every stored response as it was.
"""
from __future__ import annotations

import secrets
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request

from engine.api.errors import APIError
from engine.api.generation import Generation
from engine.api.replies import ReplyText
from engine.api.response_items import new_item_id
from engine.api.response_store import ResponseStore, StoredResponse
from engine.api.response_turn import ResponseTurn, TurnRequest, shell
from engine.api.responses_schemas import InputItemList, NamedFunctionChoice, Response, ResponseDeleted, ResponsesRequest
from engine.api.responses_stream import response_events
from engine.api.sse import event_stream
from engine.api.state import ApiState
from engine.api.tenants import tenant_of

router = APIRouter(prefix="/v1/responses")


def _api(request: Request) -> ApiState:
    return request.app.state.api


def _store(request: Request) -> ResponseStore:
    return _api(request).responses


def _entry(request: Request, response_id: str) -> StoredResponse:
    return _store(request).get(response_id, tenant_of(request).name)


def check_tool_choice(body: ResponsesRequest) -> None:
    choice, offered = body.tool_choice, {tool.name for tool in body.tools or ()}
    if choice == "required" and not offered:
        raise APIError(400, 'tool_choice "required" needs tools', param="tool_choice")
    if isinstance(choice, NamedFunctionChoice) and choice.name not in offered:
        raise APIError(400, f"tool_choice names {choice.name!r}, which is not among the tools", param="tool_choice")


@router.post("", response_model=None)
async def create_response(body: ResponsesRequest, request: Request):
    api, store, tenant = _api(request), _store(request), tenant_of(request)
    api.check_model(body.model)
    api.check_supported(body.unsupported())
    check_tool_choice(body)
    if body.store:
        store.check_quota(tenant.name)
    api.check_kv_quota(tenant)
    namespace = tenant.namespace(body.cache_salt)
    previous = store.get(body.previous_response_id, tenant.name) if body.previous_response_id else None
    if previous is not None and previous.session.namespace != namespace:
        raise APIError(400, f"response {previous.id!r} was made with another cache_salt", param="cache_salt")
    response_id = "resp_" + secrets.token_hex(16)
    turn = TurnRequest(body, body.items(), tenant.name, namespace, previous, shell(body, response_id),
                       new_item_id("message"))
    text = ReplyText(api.tokenizer, (), api.tool_format if turn.tools else None)
    gen = await Generation.begin(lambda on_tokens, on_done: ResponseTurn.begin(api, store, turn, on_tokens, on_done))
    if not body.stream:
        return (await gen.result_unless_gone(request)).response
    await gen.started()
    return event_stream(response_events(gen, text, turn.shell, turn.message_id, api.stop_ids), gen.abandon)


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
