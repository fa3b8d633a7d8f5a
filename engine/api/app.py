"""The OpenAI-compatible HTTP server over one Engine.

Endpoints: POST /v1/chat/completions, POST /v1/completions, the Responses
API under /v1/responses, Anthropic's Messages API (POST /v1/messages and
/v1/messages/count_tokens, with Anthropic's error bodies), GET /v1/models, GET /v1/models/{model}, GET /health,
GET /metrics, and the session endpoints under /v1/sessions. The engine's
scheduler runs while the app does, so that requests from every handler batch
into shared forwards.

Every request but GET /health (and /metrics, if made public) passes the gate
(engine.api.gate): with API keys configured, a missing or unknown key is a
401; each tenant's requests in flight and every body's size are bounded.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from agentkv.engine.api import chat, completions, messages, responses, session_routes
from agentkv.engine.api.errors import install_error_handlers
from agentkv.engine.api.gate import Gate
from agentkv.engine.api.messages_errors import answer_for
from agentkv.engine.api.metrics import RequestCounter
from agentkv.engine.api.quotas import Quotas
from agentkv.engine.api.response_store import DEFAULT_MAX_RESPONSES, ResponseStore
from agentkv.engine.api.schemas import ModelCard, ModelList
from agentkv.engine.api.state import ApiState
from agentkv.engine.api.tenants import ApiKeys

if TYPE_CHECKING:
    from agentkv.engine import Engine

DRAIN_TIMEOUT_S = 30.0


def create_app(engine: "Engine", model_name: str, max_stored_responses: int = DEFAULT_MAX_RESPONSES,
               state_dir: str | Path | None = None, *, keys: ApiKeys | None = None, quotas: Quotas | None = None,
               public_metrics: bool = False, shared_state: bool = False) -> FastAPI:
    """state_dir: keep named sessions across restarts (their KV in the
    engine's disk tier, which must be under it or elsewhere on disk).
    shared_state: other replicas use state_dir and the disk tier too
    (engine.api.cluster): nothing is resumed or removed at start, each
    session and response is taken up when asked for. keys: the API keys and
    their tenants (none: open to all). quotas: what each tenant may hold and
    use. public_metrics: /metrics without a key."""
    api = ApiState.for_engine(engine, model_name, state_dir, max_stored_responses, keys, quotas, shared_state)
    store = api.responses
    if state_dir is not None and not shared_state:
        _resume(engine, api, store)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start_serving()
        try:
            yield
        finally:
            await _drain(api, store)
            engine.stop_serving()
            api.sessions.close_all()
            store.close_all()
            api.cache_pins.close_all()

    app = FastAPI(title="agentkv", description="OpenAI-compatible API of a stateful engine", lifespan=lifespan)
    app.state.api = api
    install_error_handlers(app)
    public = frozenset({"/health", "/metrics"} if public_metrics else {"/health"})
    app.add_middleware(Gate, keys=api.keys, quotas=api.quotas, public_paths=public, answer=answer_for)
    app.add_middleware(RequestCounter, metrics=api.metrics)  # outside the gate: refusals are counted too
    for module in (chat, completions, responses, messages, session_routes):
        app.include_router(module.router)

    @app.get("/health")
    def health() -> JSONResponse:
        # The scheduler thread is what serves every request: if it has died, nothing will finish.
        ready = engine.serving
        return JSONResponse({"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503)

    @app.get("/v1/models")
    def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=api.model_name, created=api.created)])

    @app.get("/v1/models/{model:path}")
    def read_model(model: str) -> ModelCard:
        api.check_model(model)
        return ModelCard(id=api.model_name, created=api.created)

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(api.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def _resume(engine: "Engine", api: ApiState, store: ResponseStore) -> None:
    """Take up saved sessions and responses; saved KV neither claims is removed."""
    engine.drop_saved_kv(api.sessions.resume() | store.resume(engine))


async def _drain(api: ApiState, store: ResponseStore) -> None:
    """Wait (bounded) for generations still running, e.g. those of clients
    that went away mid-stream, so that no session is closed under them."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while (api.engine.in_flight or api.sessions.busy_count() or store.running) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
