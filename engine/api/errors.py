"""Errors as OpenAI sends them: {"error": {"message", "type", "param", "code"}}.

Every engine error leaves sessions and the pool as they were, so each maps to a
status that tells the client whether retrying can help:
400 malformed, 401 missing or unknown API key, 404 unknown session or model,
409 busy session, 413 beyond the model's context, the KV pool's size or the
body limit, 429 a tenant's quota, the server's limit of live sessions or
(with Retry-After) a full queue, 503 (with Retry-After) out of KV cache pages now, 499 a
request cancelled because its client went away, 500 otherwise.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from agentkv.engine import (
    ContextLengthError,
    EngineError,
    InvalidRequestError,
    KVCapacityError,
    PoolTooSmallError,
    QueueFullError,
    RequestCancelledError,
    SessionBusyError,
    SessionClosedError,
    TokenizerError,
    TooManySessionsError,
)

log = logging.getLogger("agentkv.api")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def not_found(message: str, code: str, param: str | None = None) -> APIError:
    return APIError(404, message, code=code, param=param)


def from_exception(exc: BaseException) -> APIError:
    """The API error for an exception raised by the engine or the API layer."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PoolTooSmallError):  # it can never fit: retrying cannot help
        return APIError(413, str(exc), code="kv_capacity_exceeded", param="messages")
    if isinstance(exc, ContextLengthError):
        return APIError(413, str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, (InvalidRequestError, TokenizerError)):
        return APIError(400, str(exc), code="invalid_request")
    if isinstance(exc, SessionBusyError):
        return APIError(409, str(exc), code="session_busy")
    if isinstance(exc, SessionClosedError):
        return not_found(str(exc), "session_not_found")
    if isinstance(exc, TooManySessionsError):  # no Retry-After: waiting frees none, a delete does
        return APIError(429, f"the server holds its limit of {exc.limit} live sessions (--max-sessions); delete one "
                        "(DELETE /v1/sessions/{id}) first", type="server_error", code="session_limit_reached")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), type="server_error", code="server_busy", headers={"Retry-After": "1"})
    if isinstance(exc, RequestCancelledError):
        return APIError(499, str(exc), code="request_cancelled")
    if isinstance(exc, KVCapacityError):
        # Pages come back as other requests finish or sessions are deleted.
        return APIError(503, str(exc), type="server_error", code="kv_cache_full", headers={"Retry-After": "1"})
    log.error("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")


def validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    # loc starts with where the value came from ("body", "header", ...): the param is what follows.
    loc = [str(part) for part in first.get("loc", ())[1:]]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    return APIError(400, f"{param}: {message}" if param else message, code=first.get("type"), param=param)


async def _handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    return from_exception(exc).response()


async def _handle_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc).response()


async def _handle_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    code = "not_found" if exc.status_code == 404 else None
    return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _handle_validation_error)
    app.add_exception_handler(HTTPException, _handle_http_error)
    # The expected errors are answered where they are raised; anything else is
    # a bug, which Starlette answers with our 500 body and then logs.
    for expected in (APIError, EngineError, KVCapacityError, TokenizerError, Exception):
        app.add_exception_handler(expected, _handle_api_error)
