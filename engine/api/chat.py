"""POST /v1/chat/completions.

Session affinity: an `X-Session-Id` header or a `session_id` body field pins
the conversation to a persistent engine session, made on first use. Each turn
re-sends the whole history; the engine reuses the longest common prefix with
what the session holds and computes only the rest, so an edited or
re-rendered history costs a recompute from the first difference, never a
wrong answer. Without an id, each request gets a fresh session of its own,
in its tenant's namespace: the prefix cache finds only that tenant's KV.

Streaming: the engine's per-step tokens are decoded incrementally into
content deltas; tool calls go out as one tool_calls chunk at the end, then
the chunk with the finish reason, then usage (with stream_options.
include_usage), then [DONE]. An error before the first token is answered with
its HTTP status; one after it, as an error event.

Agent hints: an `X-Tool-Expected-Seconds` header says how long the client
expects to pause before the session's next turn (its tools' run time when
the reply calls tools; its user's after an answer): the session's KV is
pinned for that (engine.retention, within its cap) instead of the learned
estimate. A session's end is its DELETE (engine.api.session_routes): its
program's place is freed and its KV left to the prefix cache, unused, the
first to go.

A client that disconnects (streaming or not) cancels its request within one
step: the session is left as it was before the request, and its pages and
lease are given back.

tool_choice: "none" hides the tools from the prompt and parses no calls;
"auto", "required" and a named function offer the tools and parse calls.
A grammar enforces them (engine.structured): "required" and a named function
always yield calls to offered tools with arguments valid under their schemas;
under "auto" a call the model opens is held to the same. response_format
json_object / json_schema holds the reply to that JSON. A schema that cannot
be compiled is a 400 before anything is computed.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Annotated, AsyncIterator

from fastapi import APIRouter, Header, Request

from agentkv.engine import Conversation, TurnResult, offered_tools, tool_choice_error
from agentkv.engine.api.chat_turn import ChatTurn
from agentkv.engine.api.errors import APIError
from agentkv.engine.api.generation import Generation
from agentkv.engine.api.replies import ReplyText, usage_of
from agentkv.engine.api.schemas import (
    SESSION_ID_PATTERN,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChunkChoice,
    ChunkToolCall,
    Delta,
    NamedToolChoice,
    template_message,
)
from agentkv.engine.api.sse import DONE, error_event, event, event_stream
from agentkv.engine.api.state import ApiState
from agentkv.engine.api.tenants import tenant_of

router = APIRouter()
# An hour: past it a pause is a session left alone; the retention cap bounds the pin anyway.
MAX_EXPECTED_PAUSE_S = 3600.0
# The headers of the routes that take a whole conversation (chat completions, the Messages API).
SessionHeader = Annotated[str | None, Header(pattern=SESSION_ID_PATTERN)]
PauseHeader = Annotated[float | None, Header(ge=0, le=MAX_EXPECTED_PAUSE_S)]


def pick_session_id(body_id: str | None, header_id: str | None) -> str | None:
    if body_id and header_id and body_id != header_id:
        raise APIError(400, "X-Session-Id and session_id name different sessions", param="session_id")
    return body_id or header_id


def tool_choice(body: ChatCompletionRequest) -> str | dict | None:
    """The request's tool_choice as the engine's turn takes it."""
    return body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice


def check_tool_choice(body: ChatCompletionRequest) -> None:
    offered = [tool.function.name for tool in body.tools or ()]
    if (why := tool_choice_error(tool_choice(body), offered)) is not None:
        raise APIError(400, why, param="tool_choice")


def constraints(body: ChatCompletionRequest) -> dict:
    """The request's tool_choice, response_format and parallel_tool_calls as the engine's turn takes them."""
    choice = tool_choice(body)
    response_format = body.response_format.model_dump(by_alias=True, exclude_none=True) if body.response_format else None
    return {"tool_choice": choice, "response_format": response_format,
            "parallel_tool_calls": body.parallel_tool_calls is not False}


def pick_max_tokens(body: ChatCompletionRequest) -> int | None:
    if body.max_tokens and body.max_completion_tokens and body.max_tokens != body.max_completion_tokens:
        raise APIError(400, "max_tokens and max_completion_tokens disagree", param="max_completion_tokens")
    return body.max_completion_tokens or body.max_tokens


@dataclass(frozen=True)
class ChunkMeta:
    model: str
    id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, delta: Delta, finish_reason: str | None = None) -> ChatCompletionChunk:
        choice = ChunkChoice(delta=delta, finish_reason=finish_reason)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    x_session_id: SessionHeader = None,
    x_tool_expected_seconds: PauseHeader = None,
):
    api: ApiState = request.app.state.api
    api.check_model(body.model)
    api.check_supported(body.unsupported())
    check_tool_choice(body)
    session_id = pick_session_id(body.session_id, x_session_id)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    messages = [template_message(m) for m in body.messages]
    max_tokens = pick_max_tokens(body)
    text = ReplyText(api.tokenizer, body.stops(), api.tool_format if offered_tools(tools, tool_choice(body)) else None)
    tenant = tenant_of(request)
    gen = await Generation.begin(lambda on_tokens, on_done: ChatTurn.begin(
        api, tenant, session_id, Conversation(messages, tools), max_tokens, on_tokens, on_done,
        cache_salt=body.cache_salt, expected_pause_s=x_tool_expected_seconds, temperature=body.temperature,
        top_p=body.top_p, seed=body.seed, stop=body.stops(), ignore_eos=body.ignore_eos, **constraints(body)))
    meta = ChunkMeta(body.model)
    if not body.stream:
        return _completion(meta, text, await gen.result_unless_gone(request))
    await gen.started(request)
    return event_stream(_events(gen, text, meta, body.include_usage()), gen.abandon)


def _completion(meta: ChunkMeta, text: ReplyText, result: TurnResult) -> ChatCompletion:
    text.push(result.token_ids)
    _, reply = text.finish(result)
    message = ChatMessage(content=reply.content, tool_calls=reply.tool_calls or None)
    return ChatCompletion(
        id=meta.id, created=meta.created, model=meta.model,
        choices=[ChatChoice(message=message, finish_reason=reply.finish_reason)], usage=usage_of(result),
    )


async def _events(
    gen: Generation[TurnResult], text: ReplyText, meta: ChunkMeta, include_usage: bool
) -> AsyncIterator[str]:
    yield event(meta.chunk(Delta(role="assistant", content="")))
    async for ids in gen.tokens():
        if delta := text.push(ids):
            yield event(meta.chunk(Delta(content=delta)))
    try:
        result = await gen.result()
    except Exception as e:
        yield error_event(e)
        yield DONE
        return
    rest, reply = text.finish(result)
    if rest:
        yield event(meta.chunk(Delta(content=rest)))
    if reply.tool_calls:
        calls = [ChunkToolCall(index=i, **call.model_dump()) for i, call in enumerate(reply.tool_calls)]
        yield event(meta.chunk(Delta(tool_calls=calls)))
    yield event(meta.chunk(Delta(), reply.finish_reason))
    if include_usage:
        usage = ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[], usage=usage_of(result))
        yield event(usage)
    yield DONE
