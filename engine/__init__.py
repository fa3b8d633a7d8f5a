"""The engine: sessions, the scheduler, the turn, the runner; engine/api is its
OpenAI-compatible HTTP front.

This module is the engine's front door: what a front end (engine/api, a
client of the library) uses, by name, loaded on first use so that importing
one engine module does not import them all. engine/api imports nothing else
of the engine, nor anything of the model or the cache directly.
"""
from __future__ import annotations

if __name__ == "engine":  # a bare import from the checkout, which must not shadow another package
    __import__("agentkv").step_aside(__name__)

_EXPORTS = {
    "Engine": "agentkv.engine.engine",
    "Session": "agentkv.engine.session",
    "Conversation": "agentkv.engine.turn",
    "Turn": "agentkv.engine.turn",
    "TurnResult": "agentkv.engine.turn",
    "offered_tools": "agentkv.engine.turn",
    "Request": "agentkv.engine.request",
    "OnDone": "agentkv.engine.request",
    "OnTokens": "agentkv.engine.request",
    "Histogram": "agentkv.engine.stats",
    "EngineMetrics": "agentkv.engine.stats",
    "STALLS": "agentkv.engine.stats",
    "MessageLog": "agentkv.engine.message_log",
    "first_stop": "agentkv.engine.stops",
    "EngineError": "agentkv.engine.errors",
    "InvalidRequestError": "agentkv.engine.errors",
    "ContextLengthError": "agentkv.engine.errors",
    "SessionBusyError": "agentkv.engine.errors",
    "SessionClosedError": "agentkv.engine.errors",
    "KVCapacityError": "agentkv.engine.errors",
    "PageAccountingError": "agentkv.engine.errors",
    "ModelLoadError": "agentkv.engine.errors",
    "UnsupportedModelError": "agentkv.engine.errors",
    "RequestCancelledError": "agentkv.engine.errors",
    "QueueFullError": "agentkv.engine.errors",
    "TooManySessionsError": "agentkv.engine.errors",
    "PoolTooSmallError": "agentkv.engine.errors",
    # The model's text side, as a front end sees replies.
    "Tokenizer": "agentkv.model.tokenizer",
    "TokenizerError": "agentkv.model.tokenizer",
    "IncrementalDecoder": "agentkv.model.tokenizer",
    "ToolCallFormat": "agentkv.model.tool_calls",
    "tool_choice_error": "agentkv.model.tool_calls",
    # A front end's saved records are made durable as the KV tier's files are.
    "fsync_dir": "agentkv.cache.kv_disk",
    "replace_durably": "agentkv.cache.kv_disk",
    # How much of a prompt a front end's records share with held tokens (cache usage).
    "common_prefix_len": "agentkv.cache.tokens",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = __import__("agentkv").lazy_exports(__name__, _EXPORTS)
