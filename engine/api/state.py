"""What every route needs: the engine, the served model's name, the session
registry, the response store, the prefixes kept for cache breakpoints, the tenants' keys and quotas and the metrics,
plus the checks they all make before generating."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from agentkv.engine.api.cache_pins import CachePins
from agentkv.engine.api.errors import APIError, not_found
from agentkv.engine.api.metrics import Metrics
from agentkv.engine.api.quotas import FALLBACK_MAX_TOKENS, Quotas, check_held
from agentkv.engine.api.response_files import ResponseFiles
from agentkv.engine.api.response_store import DEFAULT_MAX_RESPONSES, ResponseStore
from agentkv.engine.api.session_files import SessionFiles
from agentkv.engine.api.sessions import SessionRegistry
from agentkv.engine.api.tenants import ApiKeys, Tenant

if TYPE_CHECKING:
    from agentkv.engine import Engine, Tokenizer, ToolCallFormat


@dataclass(eq=False)
class ApiState:
    engine: "Engine"
    model_name: str
    sessions: SessionRegistry
    responses: ResponseStore
    metrics: Metrics
    keys: ApiKeys
    quotas: Quotas
    created: int = field(default_factory=lambda: int(time.time()))
    cache_pins: CachePins = field(default_factory=CachePins)

    @classmethod
    def for_engine(cls, engine: "Engine", model_name: str, state_dir: str | Path | None = None,
                   max_stored_responses: int = DEFAULT_MAX_RESPONSES, keys: ApiKeys | None = None,
                   quotas: Quotas | None = None, shared_state: bool = False) -> "ApiState":
        """With a state directory, named sessions and stored responses are
        saved there (resume() takes up earlier ones; shared_state: replicas
        share it, each taking up what the others saved when it is asked for).
        No keys: open to all, as the one tenant "default"."""
        quotas, keys = quotas or Quotas(), keys or ApiKeys()
        # Per-tenant quotas share a server out between tenants; an open server
        # has one, which the server-wide limits (engine.limits) bound already.
        shared_out = not keys.open
        sessions = SessionRegistry(engine, SessionFiles(state_dir) if state_dir is not None else None,
                                   quotas.max_sessions if shared_out else None, shared=shared_state)
        responses = ResponseStore(max_stored_responses, ResponseFiles(state_dir) if state_dir is not None else None,
                                  quotas.max_responses if shared_out else None)
        if shared_state:
            responses.share(engine)
        return cls(engine, model_name, sessions, responses, Metrics(engine, sessions, model_name), keys, quotas)

    def check_kv_quota(self, tenant: Tenant) -> None:
        """429 if the tenant's sessions, stored responses and kept cache
        prefixes already hold their quota of KV pages (before a request adds more)."""
        limit = self.quotas.max_kv_pages
        if limit is not None and not self.keys.open:
            sessions = (self.sessions.sessions_of(tenant) + self.responses.sessions_of(tenant.name)
                        + self.cache_pins.sessions_of(tenant.name))
            check_held("KV pages (in the pool and the second tier)", self.engine.kv_pages_held(sessions), limit,
                       "delete or truncate sessions, or delete stored responses")

    @property
    def tokenizer(self) -> "Tokenizer":
        if self.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: text and chat requests are not possible", code="no_tokenizer")
        return self.engine.tokenizer

    @property
    def tool_format(self) -> ToolCallFormat:
        """How the model writes tool calls; Hermes when its template does not say."""
        return self.tokenizer.tool_call_format

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise not_found(f"the model {name!r} does not exist; this server serves {self.model_name!r}", "model_not_found", "model")

    def check_supported(self, unsupported: str | None) -> None:
        if unsupported is not None:
            raise APIError(400, f"{unsupported} is not supported by this server", code="unsupported_parameter", param=unsupported)

    @property
    def default_max_tokens(self) -> int:
        """A request's budget when it names none: --default-max-tokens, else
        the model's generation config, else FALLBACK_MAX_TOKENS."""
        model = self.engine.tokenizer.max_new_tokens if self.engine.tokenizer is not None else None
        return self.quotas.default_max_tokens or model or FALLBACK_MAX_TOKENS

    def max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """The generation budget: what was asked (by default, default_max_tokens
        or the rest of the context if less), or 413 if the prompt and that
        budget exceed the context."""
        context = self.engine.max_context
        room = context - prompt_len
        if room < 1:
            raise APIError(413, f"the prompt's {prompt_len} tokens leave no room in the model's context of {context}",
                           code="context_length_exceeded", param="messages")
        if requested is not None and requested > room:
            raise APIError(413, f"{prompt_len} prompt tokens + max_tokens {requested} exceed the model's context of {context}",
                           code="context_length_exceeded", param="max_tokens")
        return min(room, self.default_max_tokens) if requested is None else requested
