"""One chat turn: render the conversation, reuse the longest common prefix
with the session's tokens, queue only the rest, generate the reply.

Started and finished in two halves so that a server can await the middle
without a thread: `start` returns as soon as the request is queued, the
scheduler runs it, `finish` (once the request is done) hands the reply to
the session and parses it. The turn works on a fork of the session, so a
failure or a cancellation leaves the session untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cache.tokens import common_prefix_len
from engine.errors import ContextLengthError, InvalidRequestError
from engine.request import OnDone, OnTokens, Request
from engine.stops import cut_at_stop
from engine.structured import request_grammar
from model.tool_calls import parse_tool_calls

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.session import Session


@dataclass
class ChatResult:
    text: str
    tool_calls: list[dict]
    usage: dict
    finish_reason: str  # "stop", "length" or "tool_calls"
    token_ids: list[int] = field(default_factory=list)


class ChatTurn:
    def __init__(self, engine: "Engine", session: "Session | None", work: "Session", request: Request,
                 prompt_len: int, stops: list[str]):
        self.engine, self.session, self.work, self.request = engine, session, work, request
        self.prompt_len, self.stops = prompt_len, stops

    @classmethod
    def start(
        cls,
        engine: "Engine",
        messages: list[dict],
        tools: list[dict] | None = None,
        session: "Session | None" = None,
        max_tokens: int = 256,
        tool_choice: str | dict | None = None,
        response_format: dict | None = None,
        parallel_tool_calls: bool = True,
        on_tokens: OnTokens | None = None,
        on_done: OnDone | None = None,
        namespace: str = "default",
        **sampling,
    ) -> "ChatTurn":
        """Render, diff against the session and queue the turn's request.
        Without a session, the turn runs on a temporary one in namespace."""
        if engine.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: use the token-level session API")
        grammar = request_grammar(engine, tools, tool_choice, response_format, parallel_tool_calls)
        prompt = engine.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        if not prompt:
            raise InvalidRequestError("the rendered prompt is empty")
        if len(prompt) >= engine.max_context:
            raise ContextLengthError(f"the prompt's {len(prompt)} tokens leave no room in the context of {engine.max_context}")
        work = session.fork_for_turn() if session is not None else engine.session(namespace)
        try:
            reused = 0 if engine.stateless else min(common_prefix_len(work.tokens, prompt), len(prompt) - 1)
            work.truncate(reused)
            work.queue(prompt[reused:])
            req = work.start_generate(max_tokens=max_tokens, grammar=grammar, on_tokens=on_tokens, on_done=on_done,
                                      **sampling)
        except BaseException:
            work.close()
            raise
        stops = sampling.get("stop") or ()
        return cls(engine, session, work, req, len(prompt), [stops] if isinstance(stops, str) else list(stops))

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
        text = self.engine.tokenizer.decode(ids, skip_special_tokens=True)
        text, _ = cut_at_stop(text, self.stops)
        content, calls = parse_tool_calls(text)
        if session is not None and not self.engine.stateless:
            session.adopt(work)
            session.end_turn([c["name"] for c in calls])
        usage = {
            "prompt_tokens": self.prompt_len,
            "completion_tokens": len(ids),
            "total_tokens": self.prompt_len + len(ids),
            "cached_tokens": stats.reused_tokens,
            "computed_tokens": stats.computed_tokens,
            "restored_tokens": stats.restored_tokens,
        }
        return ChatResult(content, calls, usage, "tool_calls" if calls else req.finish_reason, ids)
