"""One Responses API turn on the engine: the request's items as chat
messages, what to append to which session, the generation, and the response
built and stored.

The items become chat messages after the conversation so far (the previous
responses' input and replies), as chat completions would be sent them: user
and system messages as they are (developer as system), each function_call
joined to the assistant message just before it in the same input (or a
message of its own), each function_call_output a tool message, a reply (its
text and its calls) one assistant message. The whole conversation is
rendered with the chat template. The previous response's session already
holds the KV of a prefix of that text: the text its tokens spell (its prompt,
then the reply as generated, ending at EOS, say `<|im_end|>`, where the
template also writes a newline). Only the rest, the new turn's text, is
tokenized and appended to a fork of that session; the history is neither
re-tokenized nor recomputed.

The rest is cut off the rendered text only where tokenizing it alone gives
the tokens tokenizing the whole would: at an added token (`<|im_end|>`,
`<|im_start|>`, ...), which the tokenizer splits on before anything else.
When the session's text is not a prefix of the rendering (other
instructions or tools, a reply the template writes differently, a cut inside
a character), the turn starts from a new session with the whole rendering,
and the prefix cache finds what it can: slower, never wrong.

The turn is begun and finished off the event loop (ResponseTurn), on a fork
or a new session, so an error or a cancellation changes nothing stored.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from agentkv.cache.tokens import common_prefix_len
from agentkv.engine.api.errors import APIError
from agentkv.engine.api.replies import ReplyText
from agentkv.engine.api.response_store import HeldText, ResponseStore, StoredResponse
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
from agentkv.engine.request import OnDone, OnTokens
from agentkv.engine.structured import request_grammar

if TYPE_CHECKING:
    from agentkv import Engine, Session
    from agentkv.engine.request import Request as EngineRequest
    from agentkv.engine.api.replies import Reply
    from agentkv.engine.api.state import ApiState
    from agentkv.engine.grammar import Grammar
    from agentkv.engine.stats import TurnStats
    from agentkv.model.tokenizer import Tokenizer


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
class Plan:
    base: StoredResponse | None  # whose session to fork; None: a new session
    held: HeldText | None  # what that session's tokens spell
    delta_text: str
    delta_ids: list[int]
    messages: list[dict]  # the request's items as chat messages

    @property
    def prompt_len(self) -> int:
        return (len(self.base.session) if self.base else 0) + len(self.delta_ids)


def plan(
    tokenizer: "Tokenizer", previous: StoredResponse | None, items: list[Item], instructions: str | None,
    tools: list[dict] | None, max_prompt: int | None = None,
) -> Plan:
    """What a turn appends (its items, rendered after the conversation so far) and to which session.
    With max_prompt (truncation "auto"), a longer prompt drops the conversation's oldest messages
    until it fits, and starts a new session; if even the newest alone does not, it is left whole
    (for the budget check to refuse)."""
    history = previous.conversation() if previous else []
    messages = to_messages(items, call_ids(history))
    system = [system_message(instructions)] if instructions else []
    text = tokenizer.apply_chat_template(system + history + messages, tools=tools, tokenize=False)
    base = previous if previous is not None and _continues(tokenizer, previous.held, text) else None
    held = base.held if base else None
    delta = text[held.end :] if held else text
    whole = Plan(base, held, delta, tokenizer.encode(delta), messages)
    if max_prompt is None or whole.prompt_len <= max_prompt:
        return whole
    conversation = history + messages
    for start in range(1, len(conversation)):
        text = tokenizer.apply_chat_template(system + conversation[start:], tools=tools, tokenize=False)
        ids = tokenizer.encode(text)
        if len(ids) <= max_prompt:
            return Plan(None, None, text, ids, messages)
    return whole


def _continues(tokenizer: "Tokenizer", held: HeldText, text: str) -> bool:
    if not held.is_prefix_of(text):
        return False
    rest = text[held.end :]
    return any(held.piece.endswith(a) or rest.startswith(a) for a in tokenizer.added_tokens.values())


def retokenize_reply(tokenizer: "Tokenizer", session: "Session", prompt_len: int) -> None:
    """Hold the reply as the rendered conversation tokenizes it. The model may
    spell its text in tokens the tokenizer would not choose (a grammar that
    masks token by token often makes it): kept, the next turn's prompt would
    differ from the whole conversation's. From the first such token on, the
    tail is replaced by the tokenizer's (made pending: the next turn computes
    it with its own tokens, as chat completions recompute from a difference).
    The tail starts after the last added token before the reply, where the
    tokenizer splits anyway."""
    tokens, added = session.tokens, tokenizer.added_tokens
    start = next((i + 1 for i in range(prompt_len - 1, -1, -1) if tokens[i] in added), 0)
    drawn = tokens[start:]
    canonical = tokenizer.encode(tokenizer.decode(drawn))
    if canonical != drawn:
        same = common_prefix_len(drawn, canonical)
        session.truncate(start + same)
        if canonical[same:]:
            session.queue(canonical[same:])


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
