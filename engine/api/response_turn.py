"""One Responses API turn on the engine: plan what to append (continuation),
fork or start the session, generate, and build and store the response."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.api.continuation import Plan, plan, retokenize_reply
from engine.api.held_text import HeldText
from engine.api.replies import ReplyText
from engine.api.response_items import Item, listed, new_item_id, reply_message
from engine.api.response_store import ResponseStore, StoredResponse
from engine.api.responses_schemas import (
    IncompleteDetails,
    InputTokensDetails,
    NamedFunctionChoice,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    Response,
    ResponsesRequest,
    ResponseUsage,
)
from engine.api.schemas import FunctionDefinition, Tool
from engine.request import OnDone, OnTokens
from engine.structured import request_grammar

if TYPE_CHECKING:
    from engine import Engine, Session
    from engine.request import Request as EngineRequest
    from engine.api.replies import Reply
    from engine.api.state import ApiState
    from engine.grammar import Grammar
    from engine.stats import TurnStats


@dataclass(frozen=True)
class TurnRequest:
    body: ResponsesRequest
    items: list[Item]
    tenant: str
    namespace: str  # of its sessions: the tenant's, salted; no KV is shared across namespaces
    previous: StoredResponse | None
    shell: Response  # the response as created: in progress, no output yet
    message_id: str  # of the reply's message item, named before it is written (streaming)

    @property
    def tools(self) -> list[dict] | None:
        """The tools as the chat template reads them; none with tool_choice "none"."""
        if not self.body.tools or self.body.tool_choice == "none":
            return None
        return [
            Tool(type="function", function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict,
            )).model_dump(exclude_none=True)
            for t in self.body.tools
        ]

    def grammar(self, engine: "Engine") -> "Grammar | None":
        """What the reply may be, as chat completions constrain it: calls the model opens are
        well formed, tool_choice "required" or a named function is enforced, and text.format
        holds the reply as response_format does."""
        body = self.body
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunctionChoice) else body.tool_choice
        return request_grammar(engine, self.tools, choice, body.response_format(), body.parallel_tool_calls is not False)


def shell(body: ResponsesRequest, response_id: str) -> Response:
    return Response(
        id=response_id, created_at=int(time.time()), status="in_progress", model=body.model, output=[],
        instructions=body.instructions, previous_response_id=body.previous_response_id, tools=body.tools or [],
        tool_choice=body.tool_choice or "auto", parallel_tool_calls=body.parallel_tool_calls is not False,
        temperature=body.temperature, top_p=body.top_p, max_output_tokens=body.max_output_tokens,
        store=body.store, metadata=body.metadata or {}, user=body.user, text=body.text,
        truncation=body.truncation or "disabled", reasoning=body.reasoning, max_tool_calls=body.max_tool_calls,
        top_logprobs=body.top_logprobs, prompt_cache_key=body.prompt_cache_key,
        prompt_cache_retention=body.prompt_cache_retention, safety_identifier=body.safety_identifier,
    )


@dataclass(frozen=True)
class Turn:
    response: Response
    token_ids: list[int]


class ResponseTurn:
    """The engine work of one response, begun and finished off the event
    loop: the response is stored (store=true) when it is finished, so a
    client that has gone away leaves nothing unaccounted for. On error or
    cancellation nothing is changed."""

    def __init__(self, api: "ApiState", store: ResponseStore, turn: TurnRequest, p: Plan, session: "Session",
                 req: "EngineRequest", start: float):
        self.api, self.store, self.turn, self.plan, self.session, self.req = api, store, turn, p, session, req
        self.start = start

    @classmethod
    def begin(cls, api: "ApiState", store: ResponseStore, turn: TurnRequest, on_tokens: OnTokens,
              on_done: OnDone) -> "ResponseTurn":
        start = time.perf_counter()
        tokenizer = api.tokenizer
        requested = turn.body.max_output_tokens
        max_prompt = api.engine.max_context - (requested or 1) if turn.body.truncation == "auto" else None
        p = plan(tokenizer, turn.previous, turn.items, turn.body.instructions, turn.tools, max_prompt)
        max_tokens = api.max_tokens(p.prompt_len, requested)
        grammar = turn.grammar(api.engine)
        session = p.base.fork() if p.base else api.engine.session(turn.namespace)
        try:
            session.queue(p.delta_ids)
            body = turn.body
            req = session.start_generate(
                max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, ignore_eos=body.ignore_eos,
                grammar=grammar, on_tokens=on_tokens, on_done=on_done,
            )
        except BaseException:
            session.close()
            raise
        store.enter()
        return cls(api, store, turn, p, session, req, start)

    def cancel(self) -> None:
        self.req.cancel()

    def finish(self) -> Turn:
        api, turn, session, req = self.api, self.turn, self.session, self.req
        try:
            if req.error is not None:
                raise req.error
            ids, stats = req.output, req.turn
            reply = _reply(api, turn, ids)
            response = _finished(turn, reply, stats, len(ids))
            if turn.body.store:
                tokenizer = api.tokenizer
                retokenize_reply(tokenizer, session, stats.prompt_tokens)
                session.end_turn([call.function.name for call in reply.tool_calls])
                held = HeldText(self.plan.held, self.plan.delta_text + tokenizer.decode(ids))
                messages = self.plan.messages + [reply_message(reply.content, reply.tool_calls)]
                self.store.put(StoredResponse(response, turn.tenant, listed(turn.items), messages, turn.previous,
                                              held, session))
            else:
                session.close()
        except BaseException:
            session.close()
            raise
        finally:
            self.store.leave()
        api.metrics.observe_turn(time.perf_counter() - self.start)
        return Turn(response, ids)


def _reply(api: "ApiState", turn: TurnRequest, ids: list[int]) -> "Reply":
    text = ReplyText(api.tokenizer, (), api.tool_format if turn.tools else None)
    text.push(ids)
    return text.finish(ids, api.stop_ids)[1]


def _finished(turn: TurnRequest, reply: "Reply", stats: "TurnStats", generated: int) -> Response:
    cut = reply.finish_reason == "length"
    status = "incomplete" if cut else "completed"
    output: list[OutputItem] = []
    if reply.content is not None:
        output.append(OutputMessage(id=turn.message_id, status=status, content=[OutputText(text=reply.content)]))
    output += [
        OutputFunctionCall(id=new_item_id("function_call"), call_id=call.id, name=call.function.name,
                           arguments=call.function.arguments, status="completed")
        for call in reply.tool_calls
    ]
    usage = ResponseUsage(
        input_tokens=stats.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=stats.reused_tokens, cache_write_tokens=stats.computed_tokens),
        output_tokens=generated, total_tokens=stats.prompt_tokens + generated,
    )
    incomplete = IncompleteDetails(reason="max_output_tokens") if cut else None
    return turn.shell.model_copy(update={"status": status, "output": output, "usage": usage, "incomplete_details": incomplete})

