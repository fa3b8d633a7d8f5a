"""What every route needs: the engine, the served model's name, the session
registry and the metrics, plus the checks they all make before generating."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.api.errors import APIError, not_found
from engine.api.metrics import Metrics
from engine.api.session_files import SessionFiles
from engine.api.sessions import SessionRegistry
from engine.structured import tool_call_format

if TYPE_CHECKING:
    from engine import Engine
    from model.tokenizer import Tokenizer


@dataclass(eq=False)
class ApiState:
    engine: "Engine"
    model_name: str
    sessions: SessionRegistry
    metrics: Metrics
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def for_engine(cls, engine: "Engine", model_name: str, state_dir: str | Path | None = None) -> "ApiState":
        """With a state directory, named sessions are saved there (SessionRegistry.resume takes up earlier ones)."""
        sessions = SessionRegistry(engine, files=SessionFiles(state_dir) if state_dir is not None else None)
        return cls(engine, model_name, sessions, Metrics(engine, sessions, model_name))

    @property
    def tokenizer(self) -> "Tokenizer":
        if self.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: text and chat requests are not possible", code="no_tokenizer")
        return self.engine.tokenizer

    @property
    def tool_format(self) -> str:
        """How the model writes tool calls; Hermes when its template does not say."""
        return tool_call_format(self.tokenizer)

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise not_found(f"the model {name!r} does not exist; this server serves {self.model_name!r}", "model_not_found", "model")

    def check_supported(self, unsupported: str | None) -> None:
        if unsupported is not None:
            raise APIError(400, f"{unsupported} is not supported by this server", code="unsupported_parameter", param=unsupported)

    def max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """The generation budget: what was asked (by default, the rest of the
        context), or 413 if the prompt and that budget exceed the context."""
        context = self.engine.max_context
        room = context - prompt_len
        if room < 1:
            raise APIError(413, f"the prompt's {prompt_len} tokens leave no room in the model's context of {context}",
                           code="context_length_exceeded", param="messages")
        if requested is not None and requested > room:
            raise APIError(413, f"{prompt_len} prompt tokens + max_tokens {requested} exceed the model's context of {context}",
                           code="context_length_exceeded", param="max_tokens")
        return room if requested is None else requested

    @property
    def stop_ids(self) -> list[int]:
        return self.engine.eos_token_ids
