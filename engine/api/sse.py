"""Server-sent events as OpenAI streams them: one `data: <json>` event per
chunk, `data: [DONE]` at the end, and an error that happens after the stream
has begun as one `data: {"error": ...}` event before [DONE]."""
from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from engine.api.errors import from_exception

DONE = "data: [DONE]\n\n"


def event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def error_event(exc: BaseException) -> str:
    return f"data: {json.dumps(from_exception(exc).body())}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
