"""What a step's rows become: prompt work counted, an append's logits kept,
every finishing row verified and sampled in one batched pass
(engine.emit.verdicts), accepted tokens checked against the grammar and the
stops, streamed, and a finished request's turn filed. A request that fails
here fails alone, rolled back to where it was submitted."""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Iterable

from agentkv.cache.pool import PagePool
from agentkv.engine.emit import verdicts
from agentkv.engine.errors import EngineError
from agentkv.engine.kv_policy import KVPolicy
from agentkv.engine.request import Request
from agentkv.engine.request_queue import RequestQueue
from agentkv.engine.stats import SchedulerCounters, TurnStats
from agentkv.engine.step_observer import Observers
from agentkv.engine.stops import first_stop
from agentkv.engine.trace import span
from agentkv.engine.work import Work
from agentkv.spec.drafters import Drafters

log = logging.getLogger("agentkv.scheduler")


class OutputProcessor:
    def __init__(self, pool: PagePool, policy: KVPolicy, queue: RequestQueue, drafters: Drafters,
                 counters: SchedulerCounters, observers: Observers, max_context: int, max_stats: int,
                 decode: Callable[[list[int]], str] | None):
        self.pool, self.policy, self.queue, self.drafters = pool, policy, queue, drafters
        self.counters, self.observers = counters, observers
        self.max_context = max_context
        self.decode = decode  # for stop strings
        self.stats: deque[TurnStats] = deque(maxlen=max_stats)  # the latest finished turns
        self.turn_totals: dict[str, float] = {}  # every finished turn's stats, summed

    def emit(self, work: list[Work], rows: Iterable, elapsed: float) -> None:
        """Apply one step's rows (one per work, in order), elapsed seconds of forward."""
        finishing = []
        for w, r in zip(work, rows):
            turn = w.req.seq.turn
            if w.item is None:  # drawn from held logits: no forward of its own
                pass
            elif w.draft is None or not w.req.output:  # prompt work
                turn.prefill_s += elapsed
                turn.computed_tokens += len(w.item.tokens) - len(w.draft or ())
                if w.draft is None and w.item.table.length % self.pool.page_size == 0:
                    # A chunk short of the prompt's end, ending on a page: others may match it now.
                    self.policy.publish(w.req.seq)
            else:
                turn.decode_s += elapsed
                turn.decode_steps += 1
            if w.req.is_append:
                self._take_logits(w, r)
            elif w.draft is not None:
                finishing.append((w, r))
        if not finishing:
            return
        reqs, drafts = [w.req for w, _ in finishing], [w.draft for w, _ in finishing]
        try:
            with span("sample"):
                results = verdicts(reqs, [r for _, r in finishing], drafts)
        except Exception as e:  # the batched verify itself: every finishing request
            results = [e] * len(reqs)
        for req, draft, v in zip(reqs, drafts, results):
            if isinstance(v, BaseException):
                self.fail(req, v)
                continue
            try:
                self._advance(req, draft, v.accepted, v.token)
            except Exception as e:  # a stream consumer, a grammar: this request's failure only
                self.fail(req, e)

    def _take_logits(self, w: Work, rows) -> None:
        req, seq = w.req, w.req.seq
        # The rows are of the chunk's last positions, up to the table's end
        # (the runner has advanced it); keep those of appended tokens.
        first_row = seq.table.length - w.item.num_logits
        skip = max(0, len(seq.tokens) - req.num_logits - first_row)
        if skip < len(rows):
            req.logits.append(rows[skip:])
        if w.draft is not None:
            seq.last_logits = rows[-1]
            self.finish(req)

    def _advance(self, req: Request, draft: list[int], accepted: int, token: int) -> None:
        seq = req.seq
        if draft:
            seq.draft_index(self.drafters.new).record(len(draft), accepted)
            seq.turn.drafted_tokens += len(draft)
            seq.turn.accepted_tokens += accepted
            seq.turn.verify_steps += 1
            forced = min(req.forced, len(draft))
            seq.turn.forced_tokens += forced
            seq.turn.forced_accepted += min(accepted, forced)
        new = draft[:accepted] + [token]
        for i in range(len(new)):
            if req.grammar is not None and not req.grammar.accept(new[i]):
                raise EngineError(f"token {new[i]} was drawn against the grammar")
            if self._stops(req, req.output + new[: i + 1], len(seq.tokens) + i + 1):
                new = new[: i + 1]
                break
        # KV was computed for the chunk's last token and every draft; keep it
        # for the accepted ones only: the newest token stays pending.
        seq.tokens.extend(new)
        seq.table.truncate(min(seq.table.length, len(seq.tokens) - 1))
        seq.last_logits = None
        req.ready_logits = None
        req.output.extend(new)
        seq.turn.generated_tokens += len(new)
        if self.observers:
            self.observers.verdict(req, draft, accepted, new)
        if req.on_tokens is not None:
            req.on_tokens(new)
        if req.finish_reason is not None:
            seq.finish_reason = req.finish_reason
            self.drafters.finished(seq.namespace, req.output)
            self._file_turn(req)
            self.finish(req)

    def _stops(self, req: Request, out: list[int], n_total: int) -> bool:
        """Whether the output `out` ends the request (sets its finish reason)."""
        p = req.params
        if out[-1] in req.stop_ids or (req.grammar is not None and req.grammar.terminated):
            req.finish_reason = "stop"
        elif p.stop and self._ends_with_stop(out, p.stop):
            req.finish_reason = "stop"
        elif len(out) >= p.max_tokens or n_total >= self.max_context:
            req.finish_reason = "length"
        return req.finish_reason is not None

    def _ends_with_stop(self, out: list[int], stops: tuple[str, ...]) -> bool:
        # Only the tail can newly contain a stop string: decode a window long
        # enough for the longest one.
        with span("detokenize"):
            tail = self.decode(out[-(max(map(len, stops)) + 8) :])
        return first_stop(tail, stops) is not None

    def _file_turn(self, req: Request) -> None:
        seq = req.seq
        self.policy.publish(seq)
        req.turn = seq.turn
        seq.turn.preemptions = req.preemptions
        self.stats.append(seq.turn)
        for name, value in seq.turn.as_dict().items():
            self.turn_totals[name] = self.turn_totals.get(name, 0) + value
        seq.turn = TurnStats()

    def finish(self, req: Request) -> None:
        """req leaves the queue, its sequence is idle again, its waiters wake."""
        self.queue.remove(req)
        req.seq.busy = False
        req.seq.idle_since = time.monotonic()
        if req.error is None:
            self.counters.finished += 1
        req.done.set()
        if req.on_done is not None:
            try:
                req.on_done(req)
            except Exception:  # the waiter's problem; the scheduler goes on
                log.exception("a request's completion callback failed")

    def fail(self, req: Request, error: BaseException) -> None:
        """req fails with error, its sequence rolled back to where it was submitted."""
        if req.done.is_set():
            return
        seq = req.seq
        seq.rollback(req.start_len)
        seq.table.truncate(min(seq.table.length, req.start_held))
        req.error = error
        req.output = []
        req.logits = []
        self.counters.failed += 1
        self.finish(req)
