from engine.engine import ChatResult, Engine
from engine.errors import (
    ContextLengthError,
    EngineError,
    InvalidRequestError,
    KVCapacityError,
    ModelLoadError,
    SessionBusyError,
    SessionClosedError,
    UnsupportedModelError,
)
from engine.session import Session

__all__ = [
    "Engine",
    "Session",
    "ChatResult",
    "EngineError",
    "InvalidRequestError",
    "ContextLengthError",
    "KVCapacityError",
    "SessionBusyError",
    "SessionClosedError",
    "ModelLoadError",
    "UnsupportedModelError",
]
