"""Typed errors of the engine. Each leaves every session and the pool as they were."""
from cache.errors import KVCapacityError, PageAccountingError
from model.errors import ModelLoadError, UnsupportedModelError

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
