"""POST /v1/completions: raw text (or token ids) in, text out.

Each request runs on a temporary session of its own, closed when it ends; the
prefix cache still finds what earlier requests of its tenant (and
cache_salt) computed, and reports it as cached tokens. Streaming and disconnects (which cancel the request) behave
as for chat completions.
"""
from __future__ import annotations

import secrets
import time
from typing import AsyncIterator

from fastapi import APIRouter, Request

from agentkv.engine import OnDone, OnTokens, Turn, TurnResult
from agentkv.engine.api.errors import APIError
from agentkv.engine.api.generation import Generation
from agentkv.engine.api.replies import ReplyText, usage_of
from agentkv.engine.api.schemas import Completion, CompletionChoice, CompletionRequest, Usage
from agentkv.engine.api.sse import DONE, error_event, event, event_stream
from agentkv.engine.api.state import ApiState
from agentkv.engine.api.tenants import Tenant, tenant_of

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request):
    api: ApiState = request.app.state.api
    api.check_model(body.model)
    api.check_supported(body.unsupported())
    text = ReplyText(api.tokenizer, body.stops(), None)
    tenant = tenant_of(request)
    gen = await Generation.begin(lambda on_tokens, on_done: _Completion.begin(api, tenant, body, on_tokens, on_done))
    cid, created = "cmpl-" + secrets.token_hex(12), int(time.time())

    def completion(choice: CompletionChoice | None, usage: Usage | None = None) -> Completion:
        return Completion(id=cid, created=created, model=body.model, choices=[choice] if choice else [], usage=usage)

    if not body.stream:
        out = await gen.result_unless_gone(request)
        text.push(out.token_ids)
        _, reply = text.finish(out)
        return completion(CompletionChoice(text=reply.content, finish_reason=reply.finish_reason), usage_of(out))
    await gen.started(request)

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
        rest, reply = text.finish(out)
        yield event(completion(CompletionChoice(text=rest, finish_reason=reply.finish_reason)))
        if body.include_usage():
            yield event(completion(None, usage_of(out)))
        yield DONE

    return event_stream(events(), gen.abandon)


class _Completion:
    """A completion: one turn on a temporary session of its own."""

    def __init__(self, api: ApiState, turn: Turn, start: float):
        self.api, self.turn, self.start = api, turn, start

    @classmethod
    def begin(cls, api: ApiState, tenant: Tenant, body: CompletionRequest, on_tokens: OnTokens,
              on_done: OnDone) -> "_Completion":
        start = time.perf_counter()
        api.check_kv_quota(tenant)
        prompt = api.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        turn = api.engine.start_turn(
            prompt, max_tokens=lambda prompt_len: api.max_tokens(prompt_len, body.max_tokens),
            temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=body.stops(),
            ignore_eos=body.ignore_eos, on_tokens=on_tokens, on_done=on_done,
            namespace=tenant.namespace(body.cache_salt),
        )
        return cls(api, turn, start)

    def cancel(self) -> None:
        self.turn.cancel()

    def finish(self) -> TurnResult:
        result = self.turn.finish()
        self.api.metrics.observe_turn(time.perf_counter() - self.start)
        return result
