"""One Responses API turn: the request's items as chat messages, the
engine's turn (engine.turn, as chat completions run it) on the previous
response's session, and the response built and stored.

The items become chat messages after the conversation so far (the previous
responses' input and replies), as chat completions would be sent them: user
and system messages as they are (developer as system), each function_call
joined to the assistant message just before it in the same input (or a
message of its own), each function_call_output a tool message, a reply (its
text and its calls) one assistant message; the instructions, a system
message first. The engine's turn runs on a fork of the previous response's
session (a new session without one): its message log continues the
conversation natively, the new items alone rendered and computed; where it
does not match (other instructions or tools), the rendering's longest
common prefix with the session is reused. Truncation "auto" drops the
oldest messages until the prompt fits.

The turn is begun and finished off the event loop (ResponseTurn), on a fork
or a new session, so an error or a cancellation changes nothing stored.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from agentkv.engine import Conversation, OnDone, OnTokens, Turn, TurnResult
from agentkv.engine.api.errors import APIError
from agentkv.engine.api.replies import Reply, reply_of
from agentkv.engine.api.response_store import ResponseStore, StoredResponse
from agentkv.engine.api.responses_schemas import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    Item,
    MessageItem,
    NamedFunctionChoice,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    Response,
    ResponsesRequest,
    ResponseUsage,
)
from agentkv.engine.api.schemas import (
    AssistantMessage,
    FunctionCall,
    FunctionDefinition,
    Message,
    ResponseToolCall,
    SystemMessage,
    Tool,
    ToolCall,
    ToolMessage,
    UserMessage,
    template_message,
)

if TYPE_CHECKING:
    from agentkv.engine.api.state import ApiState


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


@dataclass(frozen=True)
class ResponseInput:
    body: ResponsesRequest
    items: list[Item]
    tenant: str
    namespace: str  # of its sessions: the tenant's, salted; no KV is shared across namespaces
    previous: StoredResponse | None
    shell: Response  # the response as created: in progress, no output yet
    message_id: str  # of the reply's message item, named before it is written (streaming)

    @property
    def storing(self) -> str | None:
        """The tenant the response is stored for (store=true), else None."""
        return self.tenant if self.body.store else None

    @property
    def tools(self) -> list[dict] | None:
        """The tools as the chat template reads them."""
        if not self.body.tools:
            return None
        return [
            Tool(type="function", function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict,
            )).model_dump(exclude_none=True)
            for t in self.body.tools
        ]

    @property
    def tool_choice(self) -> str | dict | None:
        choice = self.body.tool_choice
        return choice.model_dump() if isinstance(choice, NamedFunctionChoice) else choice


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
class Finished:
    response: Response
    result: TurnResult  # the engine's


class ResponseTurn:
    """The engine's turn for one response, begun and finished off the event
    loop: the response is stored (store=true) when it is finished, so a
    client that has gone away leaves nothing unaccounted for. On error or
    cancellation nothing is changed."""

    def __init__(self, api: "ApiState", store: ResponseStore, turn: ResponseInput, messages: list[dict],
                 engine_turn: "Turn", start: float):
        self.api, self.store, self.turn, self.messages, self.engine_turn = api, store, turn, messages, engine_turn
        self.start = start

    @classmethod
    def begin(cls, api: "ApiState", store: ResponseStore, turn: ResponseInput, on_tokens: OnTokens,
              on_done: OnDone) -> "ResponseTurn":
        start = time.perf_counter()
        body, previous = turn.body, turn.previous
        history = previous.conversation() if previous else []
        messages = to_messages(turn.items, call_ids(history))
        system = [system_message(body.instructions)] if body.instructions else []
        requested = body.max_output_tokens
        engine = api.engine
        store.enter(turn.storing)
        try:
            # The turn's own: stored with the response, or closed.
            session = previous.fork() if previous else engine.session(turn.namespace, counted=False)
            engine_turn = engine.start_turn(
                Conversation(system + history + messages, turn.tools), session, owned=True,
                max_tokens=lambda prompt_len: api.max_tokens(prompt_len, requested), tool_choice=turn.tool_choice,
                response_format=body.response_format(), parallel_tool_calls=body.parallel_tool_calls is not False,
                truncate_to=engine.max_context - (requested or 1) if body.truncation == "auto" else None,
                # The session holds what rendering the whole conversation gives, so a
                # continuation answers as the same history sent whole would be.
                canonical_reply=True,
                # A stored response may be continued by many branches, each with
                # other items: an opening held in its session would be computed
                # for all and kept by few.
                preposition=False,
                temperature=body.temperature, top_p=body.top_p, ignore_eos=body.ignore_eos,
                on_tokens=on_tokens, on_done=on_done,
            )
        except BaseException:
            store.leave(turn.storing)
            raise
        return cls(api, store, turn, messages, engine_turn, start)

    def cancel(self) -> None:
        self.engine_turn.cancel()

    def finish(self) -> Finished:
        turn = self.turn
        try:
            result = self.engine_turn.finish()
            reply = reply_of(result)
            response = _finished(turn, reply, result.usage)
            if turn.body.store:
                messages = self.messages + [reply_message(reply.content, reply.tool_calls)]
                self.store.put(StoredResponse(response, turn.tenant, listed(turn.items), messages, turn.previous,
                                              result.session))
            else:
                result.session.close()
        finally:
            self.store.leave(turn.storing)
        self.api.metrics.observe_turn(time.perf_counter() - self.start)
        return Finished(response, result)


def _finished(turn: ResponseInput, reply: Reply, usage: dict) -> Response:
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
    prompt, generated = usage["prompt_tokens"], usage["completion_tokens"]
    details = InputTokensDetails(cached_tokens=usage["cached_tokens"], cache_write_tokens=usage["computed_tokens"])
    response_usage = ResponseUsage(input_tokens=prompt, input_tokens_details=details, output_tokens=generated,
                                   total_tokens=prompt + generated)
    incomplete = IncompleteDetails(reason="max_output_tokens") if cut else None
    return turn.shell.model_copy(update={"status": status, "output": output, "usage": response_usage,
                                         "incomplete_details": incomplete})
