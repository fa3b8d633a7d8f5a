"""The Anthropic Messages API: POST /v1/messages and
POST /v1/messages/count_tokens.

A request is the chat completions route's turn in another shape: its
conversation becomes the same chat messages (engine.api.messages_prompt)
and runs as one engine turn (engine.api.chat_turn), with the same session
header (`X-Session-Id`: a conversation re-sent continues the held tokens,
only its new messages computed), the same retention hint
(`X-Tool-Expected-Seconds`), tenancy, quotas and grammar-constrained tool
calls (tool_choice any / tool always yield calls to offered tools with
inputs valid under their input_schema). API keys come as `x-api-key` or
`Authorization: Bearer` (engine.api.gate).

cache_control breakpoints keep their prefixes for their TTL
(engine.api.cache_pins), and usage counts what was read from the cache and
what was written under a breakpoint (engine.api.messages_cache).
count_tokens gives the prompt's length as the turn would render it whole
(input_tokens + cache_read_input_tokens + cache_creation_input_tokens of
its reply, for a conversation not continued from held tokens spelt
otherwise).

Errors are Anthropic's bodies and statuses (engine.api.messages_errors); a
refused request changes nothing.
"""
from __future__ import annotations

from fastapi import APIRouter, Request

from agentkv.engine import Conversation, TurnResult
from agentkv.engine.api.chat import PauseHeader, SessionHeader
from agentkv.engine.api.chat_turn import ChatTurn
from agentkv.engine.api.generation import Generation
from agentkv.engine.api.messages_cache import MarkedPrefixes
from agentkv.engine.api.messages_errors import MessagesRoute
from agentkv.engine.api.messages_prompt import chat_prompt
from agentkv.engine.api.messages_reply import MessageMeta, Stop, content_of, stop_of
from agentkv.engine.api.messages_schemas import MessagesPrompt, MessagesRequest, MessagesUsage, TokenCount
from agentkv.engine.api.messages_stream import events
from agentkv.engine.api.replies import ReplyText
from agentkv.engine.api.sse import event_stream
from agentkv.engine.api.state import ApiState
from agentkv.engine.api.tenants import tenant_of

router = APIRouter(prefix="/v1/messages", route_class=MessagesRoute)


@router.post("", response_model=None)
async def create_message(
    body: MessagesRequest,
    request: Request,
    x_session_id: SessionHeader = None,
    x_tool_expected_seconds: PauseHeader = None,
):
    api: ApiState = request.app.state.api
    api.check_model(body.model)
    prompt = chat_prompt(body)
    tenant = tenant_of(request)
    tokenizer, stops = api.tokenizer, body.stops()
    marked = MarkedPrefixes(api.cache_pins, tenant.name, tokenizer, prompt.breakpoints, prompt.tools)
    text = ReplyText(tokenizer, stops, api.tool_format if prompt.tools else None)
    gen = await Generation.begin(lambda on_tokens, on_done: ChatTurn.begin(
        api, tenant, x_session_id, Conversation(prompt.messages, prompt.all_tools), body.max_tokens,
        on_tokens, on_done, expected_pause_s=x_tool_expected_seconds,
        keep=marked.keep if prompt.breakpoints else None, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, stop=stops, tool_choice=prompt.tool_choice, parallel_tool_calls=prompt.parallel_tool_calls))
    meta = MessageMeta(body.model)

    def finish(result: TurnResult) -> tuple[Stop, MessagesUsage]:
        return stop_of(result, stops, tokenizer), marked.usage(result)

    if not body.stream:
        result = await gen.result_unless_gone(request)
        return meta.message(content_of(result), *finish(result))
    await gen.started(request)
    return event_stream(events(gen, text, meta, gen.pending.turn.prompt_len, finish), gen.abandon)


@router.post("/count_tokens")
def count_tokens(body: MessagesPrompt, request: Request) -> TokenCount:
    api: ApiState = request.app.state.api
    api.check_model(body.model)
    prompt = chat_prompt(body)
    ids = api.tokenizer.apply_chat_template(prompt.messages, tools=prompt.tools, add_generation_prompt=True)
    return TokenCount(input_tokens=len(ids))

