"""The session endpoints: create, read, fork, truncate, delete, and the
retention controls: retain (keep its KV in the pool for so many seconds, as
a client that knows how long its tool takes says), release (let it give
way now) and restore (bring its KV back from disk to host memory ahead of
its next turn).

A session that has a request in flight cannot be forked, truncated,
deleted, retained or released (409); it can be read, and its info says it
is busy. An unknown session (or another tenant's) is a 404 that changes
nothing.
"""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path, Request

from engine.api.schemas import (
    SESSION_ID_PATTERN, RetainRequest, SessionCreateRequest, SessionInfo, SessionList, TruncateRequest,
)
from engine.api.state import ApiState

router = APIRouter(prefix="/v1/sessions")
SessionPath = Annotated[str, Path(pattern=SESSION_ID_PATTERN)]


def _api(request: Request) -> ApiState:
    return request.app.state.api


@router.post("")
def create_session(request: Request, body: Annotated[SessionCreateRequest | None, Body()] = None) -> SessionInfo:
    sessions = _api(request).sessions
    return sessions.info(sessions.create(body.session_id if body else None))


@router.get("")
def list_sessions(request: Request) -> SessionList:
    sessions, files = _api(request).sessions, request.app.state.responses.files
    return SessionList(data=sessions.list(), reports=sessions.reports() + (files.reports if files else []))


@router.get("/{session_id}")
def read_session(request: Request, session_id: SessionPath) -> SessionInfo:
    return _api(request).sessions.info(session_id)


@router.post("/{session_id}/fork")
def fork_session(request: Request, session_id: SessionPath) -> SessionInfo:
    sessions = _api(request).sessions
    return sessions.info(sessions.fork(session_id))


@router.post("/{session_id}/truncate")
def truncate_session(request: Request, session_id: SessionPath, body: TruncateRequest) -> SessionInfo:
    sessions = _api(request).sessions
    with sessions.lease(session_id) as lease:
        lease.session.truncate(body.length)
    return sessions.info(session_id)


@router.post("/{session_id}/retain")
def retain_session(request: Request, session_id: SessionPath, body: RetainRequest) -> SessionInfo:
    sessions = _api(request).sessions
    with sessions.lease(session_id) as lease:
        lease.session.retain(body.seconds)
    return sessions.info(session_id)


@router.post("/{session_id}/release")
def release_session(request: Request, session_id: SessionPath) -> SessionInfo:
    sessions = _api(request).sessions
    with sessions.lease(session_id) as lease:
        lease.session.release()
    return sessions.info(session_id)


@router.post("/{session_id}/restore")
def restore_session(request: Request, session_id: SessionPath) -> SessionInfo:
    sessions = _api(request).sessions
    with sessions.lease(session_id) as lease:
        lease.session.prefetch()
    return sessions.info(session_id)


@router.delete("/{session_id}")
def delete_session(request: Request, session_id: SessionPath) -> dict:
    _api(request).sessions.delete(session_id)
    return {"id": session_id, "object": "session.deleted", "deleted": True}
