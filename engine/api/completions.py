"""POST /v1/completions: raw text (or token ids) in, text out.

Each request runs on a temporary session of its own, closed when it ends; the
prefix cache still finds what earlier requests computed, and reports it as
cached tokens. Streaming and disconnects behave as for chat completions.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import APIRouter, Request

from engine.api.errors import APIError
from engine.api.generation import Generation, OnTokens
from engine.api.replies import ReplyText
from engine.api.schemas import Completion, CompletionChoice, CompletionRequest, Usage
from engine.api.sse import DONE, error_event, event, event_stream
from engine.api.state import ApiState

router = APIRouter()


@dataclass(frozen=True)
class Generated:
    prompt_tokens: int
    cached_tokens: int
    ids: list[int]

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, len(self.ids), self.cached_tokens)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request):
    api: ApiState = request.app.state.api
    api.check_model(body.model)
    api.check_supported(body.unsupported())
    text = ReplyText(api.tokenizer, body.stops(), None)
    gen = Generation(lambda on_tokens: _run(api, body, on_tokens))
    cid, created = "cmpl-" + secrets.token_hex(12), int(time.time())

    def completion(choice: CompletionChoice | None, usage: Usage | None = None) -> Completion:
        return Completion(id=cid, created=created, model=body.model, choices=[choice] if choice else [], usage=usage)

    if not body.stream:
        out = await gen.result()
        text.push(out.ids)
        _, reply = text.finish(out.ids, api.stop_ids)
        return completion(CompletionChoice(text=reply.content, finish_reason=reply.finish_reason), out.usage())
    await gen.started()

    async def events() -> AsyncIterator[str]:
        async for ids in gen.tokens():
            if delta := text.push(ids):
                yield event(completion(CompletionChoice(text=delta)))
        try:
            out = await gen.result()
        except Exception as e:
            yield error_event(e)
            yield DONE
            return
        rest, reply = text.finish(out.ids, api.stop_ids)
        yield event(completion(CompletionChoice(text=rest, finish_reason=reply.finish_reason)))
        if body.include_usage():
            yield event(completion(None, out.usage()))
        yield DONE

    return event_stream(events())


def _run(api: ApiState, body: CompletionRequest, on_tokens: OnTokens) -> Generated:
    """The engine calls, on the generation's thread."""
    start = time.perf_counter()
    prompt = api.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    max_tokens = api.max_tokens(len(prompt), body.max_tokens)
    with api.engine.session(api.sessions.namespace) as session:
        session.queue(prompt)
        # As Engine.chat does for its turns: the engine's stats (and /metrics) count prompt and reuse.
        cached = session.turn.reused_tokens = session.table.length
        session.turn.prompt_tokens = len(prompt)
        ids = session.generate(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
            stop=body.stops(), ignore_eos=body.ignore_eos, on_tokens=on_tokens,
        )
    api.metrics.observe_turn(time.perf_counter() - start)
    return Generated(len(prompt), cached, ids)
