"""Server-sent events as OpenAI streams them: one `data: <json>` event per
chunk, `data: [DONE]` at the end, and an error that happens after the stream
has begun as one `data: {"error": ...}` event before [DONE]."""
from __future__ import annotations

import json
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from agentkv.engine.api.errors import from_exception

DONE = "data: [DONE]\n\n"


def event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def error_event(exc: BaseException) -> str:
    return f"data: {json.dumps(from_exception(exc).body())}\n\n"


def event_stream(events: AsyncIterator[str], on_abort: Callable[[], None]) -> StreamingResponse:
    """The events as a response; on_abort is called if the stream stops
    before its end (the client went away)."""
    return StreamingResponse(_guarded(events, on_abort), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _guarded(events: AsyncIterator[str], on_abort: Callable[[], None]) -> AsyncIterator[str]:
    ended = False
    try:
        async for chunk in events:
            yield chunk
        ended = True
    finally:
        if not ended:
            on_abort()
