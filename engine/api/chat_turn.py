"""A chat turn begun on the engine for a route that takes whole
conversations (chat completions, the Messages API): the named session's
lease, the engine's turn (engine.turn), its record in the session, and the
lease given back when it ends.

A route that keeps something of the turn's session (the Messages API's
cache breakpoints) passes `keep`: it is called with the session holding the
finished turn, while the lease is still held. Without a named session the
turn then runs on a session of its own (`owned`), closed once kept, since a
temporary one is closed inside the turn.
"""
from __future__ import annotations

import time
from typing import Callable

from agentkv.engine import Conversation, OnDone, OnTokens, Session, Turn, TurnResult
from agentkv.engine.api.schemas import TurnRecord
from agentkv.engine.api.sessions import Lease
from agentkv.engine.api.state import ApiState
from agentkv.engine.api.tenants import Tenant

Keep = Callable[[Session, TurnResult], None]


class ChatTurn:
    def __init__(self, api: ApiState, lease: Lease | None, turn: Turn, start: float, keep: Keep | None,
                 own: Session | None):
        self.api, self.lease, self.turn, self.start = api, lease, turn, start
        self.keep, self.own = keep, own

    @classmethod
    def begin(
        cls, api: ApiState, tenant: Tenant, session_id: str | None, conversation: Conversation,
        requested: int | None, on_tokens: OnTokens, on_done: OnDone, *, cache_salt: str | None = None,
        expected_pause_s: float | None = None, keep: Keep | None = None, **options,
    ) -> "ChatTurn":
        """options: the engine turn's sampling and constraints (Turn.start)."""
        start = time.perf_counter()
        api.check_kv_quota(tenant)
        lease = api.sessions.lease(tenant, session_id, create=True, cache_salt=cache_salt) if session_id else None
        namespace = tenant.namespace(cache_salt)
        own = api.engine.session(namespace, counted=False) if keep is not None and lease is None else None
        session = lease.session if lease is not None else own
        try:
            # The budget depends on the prompt's length, which only the turn
            # knows without rendering the history again.
            turn = api.engine.start_turn(
                conversation, session, owned=own is not None,
                # Its own session is closed at the end: nothing would use an opening held in it.
                preposition=False if own is not None else None,
                max_tokens=lambda prompt_len: api.max_tokens(prompt_len, requested),
                on_tokens=on_tokens, on_done=on_done, namespace=namespace, expected_pause_s=expected_pause_s,
                **options,
            )
        except BaseException:  # nothing was queued: nothing else will release the lease or close the session
            if lease is not None:
                lease.release()
            if own is not None:
                own.close()
            raise
        return cls(api, lease, turn, start, keep, own)

    def cancel(self) -> None:
        self.turn.cancel()

    def finish(self) -> TurnResult:
        try:
            result = self.turn.finish()
            latency = time.perf_counter() - self.start
            self.api.metrics.observe_turn(latency)
            if self.lease is not None:
                u, t = result.usage, result.stats
                self.lease.record(TurnRecord(prompt_tokens=u["prompt_tokens"], cached_tokens=u["cached_tokens"],
                                             completion_tokens=u["completion_tokens"], latency_s=latency,
                                             queued_s=t.queued_s, prefill_s=t.prefill_s, decode_s=t.decode_s,
                                             restored_tokens=t.restored_tokens, preemptions=t.preemptions))
            held = self.lease.session if self.lease is not None else self.own
            if self.keep is not None and held is not None:
                self.keep(held, result)
            return result
        finally:
            if self.lease is not None:
                self.lease.release()
            if self.own is not None:
                self.own.close()
