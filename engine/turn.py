"""One turn, whichever API asked for it: chat completions, completions and
responses all run this. A prompt goes in (a conversation of chat messages
with its tools, or token ids), the turn finds what of it the session already
holds, queues only the rest with the request's grammar, and, once the
request is done, parses the reply once, with the template's tool-call
format, and leaves the session holding it, its retention and its message log
updated.

How a conversation finds what the session holds (the engine's `continuation`):
- native (the default): a session's message log (engine.message_log) says
  which messages its tokens are. A request that begins with exactly those
  messages has its new messages alone rendered (model.chat_suffix) and
  tokenized, and continues from the held tokens as they are: the reply as
  the model sampled it, even where re-tokenizing its text would give other
  tokens or the template would now write it otherwise. Host work is the
  new messages', not the history's.
- template-faithful, and native whenever the log does not match (a first
  turn, an edited or truncated history, other tools): render the whole
  conversation and reuse the longest common token prefix with the session,
  as a stateless server with a prefix cache would; from the first differing
  token on, the rest is recomputed, never reused stale.
Token ids reuse the longest common prefix the same way.

Whose session the turn ends in:
- none given: a temporary one in the namespace, closed when the turn ends
  (its KV stays findable in the prefix cache);
- a session (chat's session_id): the turn works on a fork and the session
  adopts it at the end, so a failure or a cancellation leaves the session
  as it was;
- a session handed over (`owned`: a fork or a new session the caller made,
  as a stored response's continuation is): the turn works on it directly,
  closes it on failure, and hands it back in the result.

Started and finished in two halves so that a server can await the middle
without a thread: `start` returns as soon as the request is queued, the
scheduler runs it, `finish` (once the request is done) parses the reply and
updates the session.
"""
from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from agentkv.cache.tokens import common_prefix_len
from agentkv.engine.errors import ContextLengthError, InvalidRequestError
from agentkv.engine.message_log import MessageLog, digest, tools_digest
from agentkv.engine.request import OnDone, OnTokens, Request
from agentkv.engine.retention import check_pause
from agentkv.engine.sequence import owner_of
from agentkv.engine.stats import TurnStats
from agentkv.engine.stops import cut_at_stop
from agentkv.engine.structured import GrammarSource, request_grammar
from agentkv.engine.trace import span
from agentkv.model.chat_suffix import render_suffix, reply_gap, tool_result_opening
from agentkv.model.tool_calls import ToolCallFormat

if TYPE_CHECKING:
    from agentkv.engine.session import Session
    from agentkv.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class Conversation:
    """A chat prompt: the whole conversation so far, as the client sends it."""

    messages: list[dict]
    tools: list[dict] | None = None


@dataclass
class TurnResult:
    text: str  # the reply's content: cut before a stop string, its tool calls taken out
    tool_calls: list[dict]  # parsed with the template's format: {"id", "name", "arguments"}
    usage: dict
    finish_reason: str  # "stop", "length" or "tool_calls"
    token_ids: list[int] = field(default_factory=list)
    session: "Session | None" = None  # the session handed over (owned), now holding the reply
    stats: TurnStats | None = None  # what the turn cost: its queueing, prefill and decode, reuse, preemptions


class TurnHost(GrammarSource, Protocol):
    """What a turn needs of the engine."""

    max_context: int
    eos_token_ids: list[int]
    continuation: str  # "native" or "template-faithful"
    stateless: bool  # nothing is reused: every turn computes its whole prompt
    preposition: bool  # after a turn's tool calls, hold the opening of their results
    # The engine's lock (reentrant, granted in order: engine.fair_lock). A
    # turn's start and its end each take it once around their several
    # session operations, which would otherwise each wait for a step.
    lock: AbstractContextManager

    def session(self, namespace: str = "default", *, counted: bool = True) -> "Session": ...

    def wait(self, request: Request) -> Request: ...


def offered_tools(tools: list[dict] | None, tool_choice: str | dict | None) -> list[dict] | None:
    """The tools the model is shown and whose calls are parsed: none under
    tool_choice "none" (the one place that says so)."""
    return (tools or None) if tool_choice != "none" else None


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # what to queue after the reused tokens
    reused: int  # tokens of the session kept as they are
    native: bool  # continued from the message log
    messages: list[dict] | None = None  # the conversation it renders (with truncation, what is left of it)


class Turn:
    def __init__(self, host: TurnHost, session: "Session | None", work: "Session", owned: bool, request: Request,
                 prompt: Prompt, prompt_len: int, stops: list[str], tools: list[dict] | None, logged: bool,
                 canonical_reply: bool, preposition: bool, expected_pause_s: float | None = None):
        self.host, self.session, self.work, self.owned, self.request = host, session, work, owned, request
        self.prompt, self.prompt_len, self.stops, self.tools = prompt, prompt_len, stops, tools
        self.logged = logged  # whether the session's message log is kept up to date
        self.canonical_reply, self.preposition = canonical_reply, preposition
        self.expected_pause_s = expected_pause_s
        # The reply's calls are read with the template's format where tools are
        # offered, never otherwise: a reply's text is never a call the client did not get.
        self.tool_format: ToolCallFormat | None = host.tokenizer.tool_call_format if tools else None

    @classmethod
    def start(
        cls,
        host: TurnHost,
        prompt: Conversation | list[int],
        session: "Session | None" = None,
        *,
        owned: bool = False,
        max_tokens: int | Callable[[int], int] = 256,
        tool_choice: str | dict | None = None,
        response_format: dict | None = None,
        parallel_tool_calls: bool = True,
        truncate_to: int | None = None,
        canonical_reply: bool = False,
        preposition: bool | None = None,
        on_tokens: OnTokens | None = None,
        on_done: OnDone | None = None,
        namespace: str = "default",
        expected_pause_s: float | None = None,
        **sampling,
    ) -> "Turn":
        """Find what the session holds, queue the rest and the turn's request.
        max_tokens may be a function of the prompt's length (a server's budget).
        truncate_to: a conversation longer than this many tokens drops its oldest
        messages (system messages at its head stay) until it fits; if even the
        newest alone does not, it is left whole for the context check to refuse.
        canonical_reply: the session ends holding the reply as the tokenizer
        spells its text, not as sampled (see canonicalize), so that it holds
        what rendering the whole conversation gives, token for token.
        preposition: whether a reply of tool calls is followed by the opening
        of their results (None: the engine's setting).
        expected_pause_s: the client's word for the pause before the session's
        next turn (its tools' run time, or its user's after an answer): the
        session's KV is pinned for it (engine.retention) instead of the
        learned estimate."""
        check_pause(expected_pause_s)
        if host.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: use the token-level session API")
        chat = isinstance(prompt, Conversation)
        if chat and not prompt.messages:
            raise InvalidRequestError("a chat turn needs at least one message")
        if not chat and not prompt:
            raise InvalidRequestError("the prompt is empty")
        tools = offered_tools(prompt.tools, tool_choice) if chat else None
        if chat and truncate_to is None:
            refuse_oversized(host, prompt.messages, tools)
        native = session is not None and host.continuation == "native" and not host.stateless
        # Before the lock: compiling a grammar can take a while, and needs only the owner.
        grammar = request_grammar(host, tools, tool_choice, response_format, parallel_tool_calls,
                                  owner_of(session.namespace if session is not None else namespace))
        # One wait for the engine's lock (the step under way), not one per session operation below.
        with host.lock:
            work = (session if owned else session.fork_for_turn() if session is not None
                    else host.session(namespace, counted=False))
            try:
                if chat:
                    planned = _plan_chat(host, work, prompt.messages, tools, native, truncate_to)
                else:
                    planned = _reuse(host, work, list(prompt))
                prompt_len = planned.reused + len(planned.ids)
                if prompt_len >= host.max_context:
                    raise ContextLengthError(
                        f"the prompt's {prompt_len} tokens leave no room in the context of {host.max_context}")
                budget = max_tokens(prompt_len) if callable(max_tokens) else max_tokens
                work.truncate(planned.reused)
                work.queue(planned.ids)
                work.turn.native_turns = int(planned.native)
                req = work.start_generate(max_tokens=budget, grammar=grammar, on_tokens=on_tokens, on_done=on_done,
                                          **sampling)
            except BaseException:
                # Nothing of the caller's changed: a fork is dropped, a handed-over session closed.
                work.close()
                raise
        stops = sampling.get("stop") or ()
        return cls(host, session, work, owned, req, planned, prompt_len,
                   [stops] if isinstance(stops, str) else list(stops), tools, chat and native, canonical_reply,
                   host.preposition if preposition is None else preposition, expected_pause_s)

    def cancel(self) -> None:
        self.request.cancel()

    def wait(self) -> TurnResult:
        self.host.wait(self.request)
        return self.finish()

    def finish(self) -> TurnResult:
        """Once the request is done: the session holds the prompt and the
        reply (or, on error, is as before, a handed-over one closed, and the
        error is raised)."""
        req, work, host = self.request, self.work, self.host
        if req.error is not None:
            work.close()
            raise req.error
        ids = req.output
        content, calls = parse_reply(host.tokenizer, ids, self.stops, self.tool_format)
        with host.lock:  # one wait for the step under way, as at the start
            held = self._hold(work)
            if held is not None:
                if self.canonical_reply:
                    canonicalize(host.tokenizer, held, self.prompt_len)
                held.end_turn([c["name"] for c in calls], self.expected_pause_s)
                if self.logged:
                    reply = reply_message(content, calls)
                    held.message_log = self._log(held, reply)
                    if calls and held.message_log is not None and self.preposition:
                        self._preposition(held, reply)
        stats = req.turn
        usage = {
            "prompt_tokens": self.prompt_len,
            "completion_tokens": len(ids),
            "total_tokens": self.prompt_len + len(ids),
            "cached_tokens": stats.reused_tokens,
            "computed_tokens": stats.computed_tokens,
            "restored_tokens": stats.restored_tokens,
            "native": self.prompt.native,
        }
        return TurnResult(content, calls, usage, "tool_calls" if calls else req.finish_reason, ids,
                          work if self.owned else None, stats)

    def _hold(self, work: "Session") -> "Session | None":
        """The session that keeps the turn, if any keeps it."""
        if self.owned:
            return None if self.host.stateless else work
        if self.session is None:
            work.close()
            return None
        if self.host.stateless:
            work.close()
            self.session.truncate(0)
            return None
        self.session.adopt(work)
        return self.session

    def _preposition(self, session: "Session", reply: dict) -> None:
        """While the tools run: hold what the template writes before their
        results, for the scheduler to compute when it is idle."""
        tokenizer = self.host.tokenizer
        opening = tool_result_opening(tokenizer, self.prompt.messages + [reply], self.tools)
        ids = tokenizer.encode(session.message_log.gap + opening) if opening else []
        # Never at the context's end: the turn it would begin could not run anyway.
        if ids and len(session) + len(ids) < self.host.max_context:
            session.preposition(ids)

    def _log(self, session: "Session", reply: dict) -> MessageLog | None:
        """The session's messages after this turn, if its next can continue
        natively: the template's text after the reply is known (see
        model.chat_suffix.reply_gap; not after a stop string, which the
        reply's text no longer holds)."""
        tokens = session.tokens
        tokenizer = self.host.tokenizer
        ended = tokens[-1] in self.host.eos_token_ids
        messages = self.prompt.messages
        gap = reply_gap(tokenizer, messages, reply, self.tools, tokenizer.decode(tokens[self.prompt_len:]),
                        tokenizer.decode(tokens[-1:]) if ended else None)
        if gap is None:
            return None
        return MessageLog(tuple(digest(m) for m in messages) + (digest(reply),), tools_digest(self.tools),
                          len(tokens), gap)


def parse_reply(tokenizer: Tokenizer, ids: list[int], stops: list[str],
                tool_format: ToolCallFormat | None) -> tuple[str, list[dict]]:
    """A reply's content, cut before its first stop string, and its tool calls
    (read only with a format: where tools are offered)."""
    with span("detokenize"):
        text = tokenizer.decode_reply(ids, tokenizer.tool_markers if tool_format else {})
    text, _ = cut_at_stop(text, stops)
    with span("parse_tools"):
        return tool_format.parse(text) if tool_format else (text, [])


# Characters per context token past which a chat is counted before the
# engine's lock. Text runs 3-5 characters a token: twice that is rarely a
# prompt that fits, so a long conversation, natively continued, is not rendered whole.
OVERSIZED_CHARS_PER_TOKEN = 8


def refuse_oversized(host: TurnHost, messages: list[dict], tools: list[dict] | None) -> None:
    """Refuse a conversation that cannot fit the context before its grammar is
    compiled and the engine's lock is taken: a client's megabyte of schema
    must cost it, not every other request's step. Exact (the rendered prompt
    is counted); only texts long enough to possibly not fit are rendered."""
    size = sum(len(str(m.get("content") or "")) for m in messages if isinstance(m, dict))
    size += len(json.dumps(tools, default=str)) if tools else 0
    if size < OVERSIZED_CHARS_PER_TOKEN * host.max_context:
        return
    with span("render"):
        prompt_len = len(host.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True))
    if prompt_len >= host.max_context:
        raise ContextLengthError(f"the prompt's {prompt_len} tokens leave no room in the context of {host.max_context}")


def canonicalize(tokenizer: Tokenizer, session: "Session", prompt_len: int) -> None:
    """Hold the reply as the rendered conversation tokenizes it. The model may
    spell its text in tokens the tokenizer would not choose (a grammar that
    masks token by token often makes it). From the first such token on, the
    tail is replaced by the tokenizer's (queued: the next turn computes it
    with its own tokens). The tail starts after the last added token before
    the reply, where the tokenizer splits anyway."""
    tokens, added = session.tokens, tokenizer.added_tokens
    start = next((i + 1 for i in range(prompt_len - 1, -1, -1) if tokens[i] in added), 0)
    drawn = tokens[start:]
    canonical = tokenizer.encode(tokenizer.decode(drawn))
    if canonical != drawn:
        same = common_prefix_len(drawn, canonical)
        session.truncate(start + same)
        if canonical[same:]:
            session.queue(canonical[same:])


def reply_message(content: str, calls: list[dict]) -> dict:
    """The reply as a client echoes it back (ids too: Mistral's templates refuse calls without them)."""
    return {"role": "assistant", "content": content or None, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
        for c in calls] or None}


def _plan_chat(host: TurnHost, work: "Session", messages: list[dict], tools: list[dict] | None, native: bool,
               truncate_to: int | None) -> Prompt:
    planned = (native_prompt(host, work, messages, tools) if native else None) \
        or rendered_prompt(host, work, messages, tools)
    if truncate_to is None or planned.reused + len(planned.ids) <= truncate_to:
        return planned
    head = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    for start in range(head + 1, len(messages)):
        shorter = rendered_prompt(host, work, messages[:head] + messages[start:], tools)
        if shorter.reused + len(shorter.ids) <= truncate_to:
            return shorter
    return planned


def native_prompt(host: TurnHost, session: "Session", messages: list[dict], tools: list[dict] | None) -> Prompt | None:
    """The new messages alone, after the held tokens; None if the session's log does not match."""
    log = session.message_log
    if log is None or not log.continues([digest(m) for m in messages], tools_digest(tools), len(session)):
        return None
    with span("render"):
        suffix = render_suffix(host.tokenizer, messages, len(log.digests), tools)
    if suffix is None:
        return None
    # Tokenized on its own: the held tokens stay as they are (after a sampled
    # end-of-turn token, an added token, this is also how the whole would tokenize).
    with span("tokenize"):
        ids = host.tokenizer.encode(log.gap + suffix)
    # What was pre-positioned is kept as far as the turn does begin so; the
    # rest of it is truncated away before the turn's tokens are queued.
    kept = common_prefix_len(ids, list(log.prepositioned)) if log.prepositioned else 0
    return Prompt(ids[kept:], log.length + kept, True, messages)


def rendered_prompt(host: TurnHost, work: "Session", messages: list[dict], tools: list[dict] | None) -> Prompt:
    """The whole conversation rendered; the longest common prefix with the session kept."""
    with span("render"):  # and tokenize: the template's text is encoded whole
        ids = host.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    if not ids:
        raise InvalidRequestError("the rendered prompt is empty")
    return _reuse(host, work, ids, messages)


def _reuse(host: TurnHost, work: "Session", ids: list[int], messages: list[dict] | None = None) -> Prompt:
    # At least the last token is computed: its logits start the reply.
    reused = 0 if host.stateless else min(common_prefix_len(work.tokens, ids), len(ids) - 1)
    return Prompt(ids[reused:], reused, False, messages)
