"""Errors as the Messages API sends them, on its routes only:
{"type": "error", "error": {"type", "message"}}, with Anthropic's statuses.

Every error the server raises (engine.api.errors) is shaped again here, so
the same conditions fail the same way on every API: a prompt beyond the
context is Anthropic's 400 (not our 413, which Anthropic keeps for bodies
too large), a full queue or KV pool its 529 overloaded_error (Retry-After
kept); statuses Anthropic does not list (409 busy session, 499 cancelled)
stay as they are. The gate's refusals (401, 413, 429) take this shape on
these paths too (`answer_for`).
"""
from __future__ import annotations

import json
from typing import Callable, Coroutine

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from agentkv.engine.api.errors import APIError, from_exception, validation_error

PATH_PREFIX = "/v1/messages"
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 529: "overloaded_error",
}
# A prompt that can never fit is a bad request at Anthropic.
_PROMPT_TOO_LONG = {"context_length_exceeded", "kv_capacity_exceeded"}
# Waiting helps: the server is busy, not the tenant over a quota.
_OVERLOADED = {"server_busy", "kv_cache_full"}


def status_of(error: APIError) -> int:
    if error.code in _PROMPT_TOO_LONG:
        return 400
    if error.code in _OVERLOADED:
        return 529
    return error.status


def body_of(error: APIError) -> dict:
    status = status_of(error)
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(body_of(error), status_code=status_of(error), headers=error.headers)


def error_event(exc: BaseException) -> str:
    """An error after the stream has begun, as one `error` event."""
    return f"event: error\ndata: {json.dumps(body_of(from_exception(exc)))}\n\n"


def answer_for(path: str, error: APIError) -> Response:
    """The gate's refusal in the shape of the API its path belongs to."""
    return error_response(error) if path.startswith(PATH_PREFIX) else error.response()


class MessagesRoute(APIRoute):
    """A route whose every error, its body's validation included, is answered in Anthropic's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[None, None, Response]]:
        handler = super().get_route_handler()

        async def shaped(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return error_response(validation_error(e))
            except Exception as e:
                return error_response(from_exception(e))

        return shaped
