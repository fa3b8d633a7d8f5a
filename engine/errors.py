"""Typed errors of the engine. Each leaves every session and the pool as they were."""
from agentkv.cache.errors import KVCapacityError, PageAccountingError
from agentkv.model.errors import ModelLoadError, UnsupportedModelError

__all__ = [
    "EngineError",
    "InvalidRequestError",
    "ContextLengthError",
    "SessionBusyError",
    "SessionClosedError",
    "KVCapacityError",
    "PageAccountingError",
    "ModelLoadError",
    "UnsupportedModelError",
    "RequestCancelledError",
    "QueueFullError",
    "TooManySessionsError",
    "PoolTooSmallError",
]


class EngineError(Exception):
    """Base of the engine's own errors."""


class InvalidRequestError(EngineError, ValueError):
    """Malformed input: a bad token id, an empty append, a bad argument."""


class ContextLengthError(InvalidRequestError):
    """The sequence would exceed the model's context window."""


class SessionBusyError(EngineError):
    """The session already has a request in flight."""


class SessionClosedError(EngineError):
    """The session was closed; its pages are gone."""


class RequestCancelledError(EngineError):
    """The request was cancelled (its client went away); nothing it did remains."""


class QueueFullError(EngineError):
    """The waiting queue is at its limit; retry later."""


class TooManySessionsError(EngineError):
    """The engine holds its limit of live sessions (Limits.max_sessions); none
    is made until one is closed."""

    def __init__(self, limit: int):
        super().__init__(f"the engine holds its limit of {limit} live sessions; close one first")
        self.limit = limit


class PoolTooSmallError(KVCapacityError, ContextLengthError):
    """The sequence can never fit in the KV pool, however much is freed."""

    def __init__(self, tokens: int, needed: int, total: int, page_size: int):
        super().__init__(needed, total, page_size)
        self.args = (f"{tokens} tokens need {needed} KV pages of {page_size} tokens; the pool holds {total} in all",)
