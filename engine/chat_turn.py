"""One chat turn: find what of the conversation the session already holds,
queue only the rest, generate the reply.

Two ways to find it (Engine's `continuation`):
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

Started and finished in two halves so that a server can await the middle
without a thread: `start` returns as soon as the request is queued, the
scheduler runs it, `finish` (once the request is done) hands the reply to
the session and parses it. The turn works on a fork of the session, so a
failure or a cancellation leaves the session untouched.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from agentkv.cache.tokens import common_prefix_len
from agentkv.engine.errors import ContextLengthError, InvalidRequestError
from agentkv.engine.message_log import MessageLog, digest, tools_digest
from agentkv.engine.request import OnDone, OnTokens, Request
from agentkv.engine.stops import cut_at_stop
from agentkv.engine.structured import request_grammar
from agentkv.engine.trace import span
from agentkv.model.chat_suffix import render_suffix, reply_gap, tool_result_opening
from agentkv.model.tool_calls import ToolCallFormat

if TYPE_CHECKING:
    from agentkv.engine.engine import Engine
    from agentkv.engine.session import Session


@dataclass
class ChatResult:
    text: str
    tool_calls: list[dict]
    usage: dict
    finish_reason: str  # "stop", "length" or "tool_calls"
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # what to queue after the reused tokens
    reused: int  # tokens of the session kept as they are
    native: bool  # continued from the message log


class ChatTurn:
    def __init__(self, engine: "Engine", session: "Session | None", work: "Session", request: Request,
                 prompt_len: int, stops: list[str], messages: list[dict], tools: list[dict] | None,
                 digests: list[bytes] | None, native: bool, tool_format: ToolCallFormat | None):
        self.engine, self.session, self.work, self.request = engine, session, work, request
        self.prompt_len, self.stops = prompt_len, stops
        self.messages, self.tools, self.digests = messages, tools, digests
        self.native = native  # whether the prompt continued the session's message log
        # How the reply's calls are read: the template's format where tools are
        # offered, as the HTTP layer reads them for the client (engine.api.replies);
        # none otherwise, so a reply's text is never a call the client did not get.
        self.tool_format = tool_format

    @classmethod
    def start(
        cls,
        engine: "Engine",
        messages: list[dict],
        tools: list[dict] | None = None,
        session: "Session | None" = None,
        max_tokens: int | Callable[[int], int] = 256,
        tool_choice: str | dict | None = None,
        response_format: dict | None = None,
        parallel_tool_calls: bool = True,
        on_tokens: OnTokens | None = None,
        on_done: OnDone | None = None,
        namespace: str = "default",
        **sampling,
    ) -> "ChatTurn":
        """Find what the session holds, queue the rest and the turn's request.
        Without a session, the turn runs on a temporary one in namespace.
        max_tokens may be a function of the prompt's length (a server's budget)."""
        if engine.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: use the token-level session API")
        if not messages:
            raise InvalidRequestError("a chat turn needs at least one message")
        grammar = request_grammar(engine, tools, tool_choice, response_format, parallel_tool_calls)
        native = session is not None and engine.continuation == "native" and not engine.stateless
        digests = [digest(m) for m in messages] if native else None
        work = session.fork_for_turn() if session is not None else engine.session(namespace)
        try:
            prompt = (native_prompt(engine, session, messages, tools, digests) if native else None) \
                or rendered_prompt(engine, work, messages, tools)
            prompt_len = prompt.reused + len(prompt.ids)
            if prompt_len >= engine.max_context:
                raise ContextLengthError(f"the prompt's {prompt_len} tokens leave no room in the context of {engine.max_context}")
            budget = max_tokens(prompt_len) if callable(max_tokens) else max_tokens
            work.truncate(prompt.reused)
            work.queue(prompt.ids)
            req = work.start_generate(max_tokens=budget, grammar=grammar, on_tokens=on_tokens, on_done=on_done,
                                      **sampling)
        except BaseException:
            work.close()
            raise
        stops = sampling.get("stop") or ()
        tool_format = engine.tokenizer.tool_call_format if tools and tool_choice != "none" else None
        return cls(engine, session, work, req, prompt_len, [stops] if isinstance(stops, str) else list(stops),
                   messages, tools, digests, prompt.native, tool_format)

    def cancel(self) -> None:
        self.request.cancel()

    def wait(self) -> ChatResult:
        self.engine.scheduler.wait(self.request)
        return self.finish()

    def finish(self) -> ChatResult:
        """Once the request is done: the session holds the prompt and the
        reply (or, on error, is as before and the error is raised)."""
        req, work, session = self.request, self.work, self.session
        if req.error is not None:
            work.close()
            raise req.error
        stats = req.turn
        if session is None:
            work.close()
        elif self.engine.stateless:
            work.close()
            session.truncate(0)
        ids = req.output
        with span("detokenize"):
            text = self.engine.tokenizer.decode(ids, skip_special_tokens=True)
        text, _ = cut_at_stop(text, self.stops)
        with span("parse_tools"):
            content, calls = self.tool_format.parse(text) if self.tool_format else (text, [])
        if session is not None and not self.engine.stateless:
            session.adopt(work)
            session.end_turn([c["name"] for c in calls])
            if self.digests is not None:
                reply = _reply_message(content, calls)
                session.message_log = self._log(session, reply)
                if calls and session.message_log is not None and self.engine.preposition:
                    self._preposition(session, reply)
        usage = {
            "prompt_tokens": self.prompt_len,
            "completion_tokens": len(ids),
            "total_tokens": self.prompt_len + len(ids),
            "cached_tokens": stats.reused_tokens,
            "computed_tokens": stats.computed_tokens,
            "restored_tokens": stats.restored_tokens,
            "native": self.native,
        }
        return ChatResult(content, calls, usage, "tool_calls" if calls else req.finish_reason, ids)

    def _preposition(self, session: "Session", reply: dict) -> None:
        """While the tools run: hold what the template writes before their
        results, for the scheduler to compute when it is idle."""
        opening = tool_result_opening(self.engine.tokenizer, self.messages + [reply], self.tools)
        ids = self.engine.tokenizer.encode(session.message_log.gap + opening) if opening else []
        # Never at the context's end: the turn it would begin could not run anyway.
        if ids and len(session) + len(ids) < self.engine.max_context:
            session.preposition(ids)

    def _log(self, session: "Session", reply: dict) -> MessageLog | None:
        """The session's messages after this turn, if its next can continue
        natively: the template's text after the reply is known (see
        model.chat_suffix.reply_gap; not after a stop string, which the
        reply's text no longer holds)."""
        tokens = session.tokens
        tokenizer = self.engine.tokenizer
        ended = tokens[-1] in self.engine.eos_token_ids
        gap = reply_gap(tokenizer, self.messages, reply, self.tools, tokenizer.decode(tokens[self.prompt_len:]),
                        tokenizer.decode(tokens[-1:]) if ended else None)
        if gap is None:
            return None
        return MessageLog(tuple(self.digests) + (digest(reply),), tools_digest(self.tools), len(tokens), gap)


def _reply_message(content: str, calls: list[dict]) -> dict:
    """The reply as a client echoes it back."""
    return {"role": "assistant", "content": content or None, "tool_calls": [
        {"type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
        for c in calls] or None}


def native_prompt(engine: "Engine", session: "Session", messages: list[dict], tools: list[dict] | None,
                   digests: list[bytes]) -> Prompt | None:
    """The new messages alone, after the held tokens; None if the session's log does not match."""
    log = session.message_log
    if log is None or not log.continues(digests, tools_digest(tools), len(session)):
        return None
    with span("render"):
        suffix = render_suffix(engine.tokenizer, messages, len(log.digests), tools)
    if suffix is None:
        return None
    # Tokenized on its own: the held tokens stay as they are (after a sampled
    # end-of-turn token, an added token, this is also how the whole would tokenize).
    with span("tokenize"):
        ids = engine.tokenizer.encode(log.gap + suffix)
    # What was pre-positioned is kept as far as the turn does begin so; the
    # rest of it is truncated away before the turn's tokens are queued.
    kept = common_prefix_len(ids, list(log.prepositioned)) if log.prepositioned else 0
    return Prompt(ids[kept:], log.length + kept, True)


def rendered_prompt(engine: "Engine", work: "Session", messages: list[dict], tools: list[dict] | None) -> Prompt:
    """The whole conversation rendered; the longest common prefix with the session kept."""
    with span("render"):  # and tokenize: the template's text is encoded whole
        prompt = engine.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    if not prompt:
        raise InvalidRequestError("the rendered prompt is empty")
    reused = 0 if engine.stateless else min(common_prefix_len(work.tokens, prompt), len(prompt) - 1)
    return Prompt(prompt[reused:], reused, False)
