"""The session endpoints: create, read, fork, truncate, delete, and the
retention controls: retain (keep its KV in the pool for so many seconds, as
a client that knows how long its tool takes says; at most the server's
max_retain_s, which is what a retain without seconds gets), release (let it give
way now) and restore (bring its KV back from disk to host memory ahead of
its next turn).

A session that has a request in flight cannot be forked, truncated,
deleted, retained or released (409); it can be read, and its info says it
is busy. An unknown session (or another tenant's) is a 404 that changes
nothing. The list holds the asking tenant's sessions only; what resuming
saved state found wrong is listed too on an open server (with keys, it is
in the server's log: it names every tenant's sessions).
"""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path, Request

from agentkv.engine.api.errors import APIError
from agentkv.engine.api.schemas import (
    SESSION_ID_PATTERN, RetainRequest, SessionCreateRequest, SessionInfo, SessionList, TruncateRequest,
)
from agentkv.engine.api.sessions import SessionRegistry
from agentkv.engine.api.state import ApiState
from agentkv.engine.api.tenants import Tenant, tenant_of

router = APIRouter(prefix="/v1/sessions")
SessionPath = Annotated[str, Path(pattern=SESSION_ID_PATTERN)]


def _api(request: Request) -> ApiState:
    return request.app.state.api


def _scope(request: Request) -> tuple[SessionRegistry, Tenant]:
    return _api(request).sessions, tenant_of(request)


@router.post("")
def create_session(request: Request, body: Annotated[SessionCreateRequest | None, Body()] = None) -> SessionInfo:
    sessions, tenant = _scope(request)
    body = body or SessionCreateRequest()
    return sessions.info(tenant, sessions.create(tenant, body.session_id, body.cache_salt))


@router.get("")
def list_sessions(request: Request) -> SessionList:
    api, (sessions, tenant) = _api(request), _scope(request)
    files = api.responses.files
    reports = sessions.reports() + (files.reports if files else []) if api.keys.open else []
    return SessionList(data=sessions.list(tenant), reports=reports)


@router.get("/{session_id}")
def read_session(request: Request, session_id: SessionPath) -> SessionInfo:
    sessions, tenant = _scope(request)
    return sessions.info(tenant, session_id)


@router.post("/{session_id}/fork")
def fork_session(request: Request, session_id: SessionPath) -> SessionInfo:
    sessions, tenant = _scope(request)
    return sessions.info(tenant, sessions.fork(tenant, session_id))


@router.post("/{session_id}/truncate")
def truncate_session(request: Request, session_id: SessionPath, body: TruncateRequest) -> SessionInfo:
    sessions, tenant = _scope(request)
    with sessions.lease(tenant, session_id) as lease:
        lease.session.truncate(body.length)
    return sessions.info(tenant, session_id)


@router.post("/{session_id}/retain")
def retain_session(request: Request, session_id: SessionPath, body: RetainRequest) -> SessionInfo:
    sessions, tenant = _scope(request)
    cap = sessions.max_retain_s
    if body.seconds is not None and body.seconds > cap:
        raise APIError(400, f"retain is capped at {cap:g} seconds on this server, got {body.seconds:g}",
                       code="retain_too_long", param="seconds")
    with sessions.lease(tenant, session_id) as lease:
        lease.session.retain(cap if body.seconds is None else body.seconds)
    return sessions.info(tenant, session_id)


@router.post("/{session_id}/release")
def release_session(request: Request, session_id: SessionPath) -> SessionInfo:
    sessions, tenant = _scope(request)
    with sessions.lease(tenant, session_id) as lease:
        lease.session.release()
    return sessions.info(tenant, session_id)


@router.post("/{session_id}/restore")
def restore_session(request: Request, session_id: SessionPath) -> SessionInfo:
    sessions, tenant = _scope(request)
    with sessions.lease(tenant, session_id) as lease:
        lease.session.prefetch()
    return sessions.info(tenant, session_id)


@router.delete("/{session_id}")
def delete_session(request: Request, session_id: SessionPath) -> dict:
    sessions, tenant = _scope(request)
    sessions.delete(tenant, session_id)
    return {"id": session_id, "object": "session.deleted", "deleted": True}
