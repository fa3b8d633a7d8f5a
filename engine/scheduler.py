"""Continuous batching over the sequences the scheduler owns.

Requests wait in one queue and run in priority order: a conversation's next
turn by when the conversation began (program-level FCFS), then by arrival.
Each step takes, in that order, what fits in the step's token budget and the
pool: a prefill chunk, the one token drawn last step, or that token plus a
speculative draft. When pages run short, unused cached prefixes and idle
sequences past their pin time give way first (engine.kv_policy); then the
lowest-priority request holding pages is preempted: its pages go (published
to the prefix cache), its tokens stay, and it re-queues to recompute what
the cache lost. One forward runs the step; one batched pass (engine.emit)
verifies and samples every finishing row. A request's failure fails that
request only, rolled back; a failure of the whole forward fails that step's
requests, and the loop goes on.

Prompt chunks end at multiples of Limits.prefill_chunk (and at the prompt's
end), so how a sequence is cut never depends on what shares its step.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from agentkv.cache.errors import KVCapacityError
from agentkv.cache.pool import PagePool
from agentkv.cache.tokens import common_prefix_len
from agentkv.engine.emit import verdicts
from agentkv.engine.errors import EngineError, PoolTooSmallError, QueueFullError, RequestCancelledError, SessionClosedError
from agentkv.engine.kv_policy import KVPolicy
from agentkv.engine.limits import Limits
from agentkv.engine.request import Request
from agentkv.engine.runner import ModelRunner, StepItem
from agentkv.engine.sequence import Sequence
from agentkv.engine.sequences import Sequences
from agentkv.engine.stats import SchedulerCounters, TurnStats
from agentkv.engine.stops import first_stop
from agentkv.engine.trace import nvtx_range
from agentkv.model.sampler import make_generator
from agentkv.spec.drafters import Drafters
from agentkv.spec.schema_phrases import MAX_PHRASE_OVERLAP, continuations

log = logging.getLogger("agentkv.scheduler")

# How often idle sessions are checked against the idle timeout.
IDLE_CHECK_S = 1.0


@dataclass(slots=True, eq=False)
class _Work:
    req: Request
    item: StepItem | None  # None: the request draws from logits it already has
    draft: list[int] | None  # None: a prompt chunk short of the end


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        pool: PagePool,
        policy: KVPolicy,
        sequences: Sequences,
        limits: Limits,
        max_context: int,
        eos_token_ids: Iterable[int],
        decode: Callable[[list[int]], str] | None = None,
        drafters: Drafters | None = None,
    ):
        self.runner, self.pool, self.policy, self.limits = runner, pool, policy, limits
        self.sequences = sequences
        sequences.on_close = self._fail_requests_of
        # The sequences' lock: also held by each step.
        self.lock = sequences.lock
        self.max_context = max_context
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode = decode  # for stop strings
        self.drafters = drafters or Drafters()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.stats: deque[TurnStats] = deque(maxlen=limits.max_stats)
        self.turn_totals: dict[str, float] = {}
        self.counters = SchedulerCounters()
        self._arrivals = itertools.count()  # of requests
        self._last_idle_check = time.monotonic()
        self._preempted_now: set[Request] = set()  # this step's: not scheduled again in it
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _fail_requests_of(self, seq: Sequence) -> None:
        for req in [r for r in self.running + self.waiting if r.seq is seq]:
            self._fail(req, SessionClosedError("the session was closed"))

    # -- requests ------------------------------------------------------

    def submit(self, req: Request, tokens: list[int] = ()) -> None:
        """Queue req after appending tokens to its sequence. Raises (and
        changes nothing) if the session is busy or closed, the queue is full,
        or the sequence could never fit in the pool."""
        with self.sequences.idle(req.seq):
            seq = req.seq
            if len(self.waiting) >= self.limits.max_queue:
                raise QueueFullError(f"{len(self.waiting)} requests are waiting, the most this server queues")
            length = len(seq.tokens) + len(tokens) + (not req.is_append)
            needed = -(-length // self.pool.page_size)
            if needed > self.pool.num_pages:
                raise PoolTooSmallError(length, needed, self.pool.num_pages, self.pool.page_size)
            req.start_len, req.start_held = len(seq.tokens), seq.table.length
            if tokens:
                seq.tokens.extend(tokens)
                seq.last_logits = None
            if not req.is_append:
                params = req.params
                req.generator = None if params.greedy else make_generator(params.seed)
                req.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
                if seq.table.length == len(seq.tokens):
                    if seq.last_logits is not None:
                        req.ready_logits = seq.last_logits[None]
                    else:
                        # No logits after truncate or fork: the last token is
                        # made pending again, so the first step computes them.
                        seq.table.truncate(len(seq.tokens) - 1)
            req.arrival = next(self._arrivals)
            req.queued_at = time.monotonic()
            self.policy.retention.resumed(seq, req.queued_at)
            if self.policy.tier is not None and seq.table.length < len(seq.tokens) - 1:
                self.policy.tier.prefetch(seq.key)
            seq.busy = True
            self.waiting.append(req)
        self._wake.set()

    def wait(self, req: Request) -> Request:
        """Until req is done: driven by the loop if one runs, else by stepping here."""
        if self.serving:
            req.done.wait()
        while not req.done.is_set():
            with self.lock:
                if not req.done.is_set():
                    self._step()
        return req

    @property
    def in_flight(self) -> int:
        """Requests queued or running."""
        return len(self.running) + len(self.waiting)

    # -- the loop ------------------------------------------------------

    @property
    def serving(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Step in a background thread, so that requests from many callers share each forward."""
        if self.serving:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="agentkv-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop; requests still queued or running fail (rolled back)."""
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
            self._thread.join()
            self._thread = None
        with self.lock:
            for req in self.running + self.waiting:
                self._fail(req, EngineError("the scheduler stopped before the request finished"))

    def wake(self) -> None:
        """Have the loop look for work now (new work it may do while idle)."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.step()
            except Exception as e:  # a bug in the scheduler itself: fail what is in flight, keep serving
                log.exception("scheduler step failed")
                with self.lock:
                    for req in self.running + self.waiting:
                        self._fail(req, e)
                busy = False
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    def step(self) -> bool:
        """One step; whether it did any work."""
        with self.lock:
            return self._step()

    def _step(self) -> bool:
        start = time.perf_counter()
        self._reap()
        work = self._schedule()
        if not work:
            return self._compute_ahead()
        items = [w.item for w in work if w.item is not None]
        logits = []
        forward_start = time.perf_counter()
        if items:
            try:
                with nvtx_range(_phase(work)):
                    logits = self.runner.step(items)
            except Exception as e:  # the whole step failed: so do its requests, and nothing else
                for w in work:
                    self._fail(w.req, e)
                return True
        forward = time.perf_counter() - forward_start
        self._measure_prefill(items, forward)
        rows = iter(logits)
        self._emit(work, [next(rows) if w.item is not None else w.req.ready_logits for w in work], forward)
        c = self.counters
        c.steps += 1
        c.batch_size.observe(len(work))
        c.forward_s += forward
        c.step_s += time.perf_counter() - start
        return True

    def _compute_ahead(self) -> bool:
        """With nothing else to do: compute the pending tokens of one idle
        sequence that holds them ahead of its next turn (pre-positioning),
        within this step and under the lock, so the sequence never looks
        busy. Only into free pages and while no request waits: nothing is
        evicted or delayed for it; what is not computed here, the next turn
        computes."""
        if self.waiting or self.running:
            return False
        for seq in self.sequences.all:
            if not seq.ahead or seq.busy or seq.closed:
                continue
            seq.ahead = False
            held, n = seq.table.length, len(seq.tokens)
            if not 0 < n - held <= self.limits.prefill_chunk or seq.table.pages_needed(n - held) > self.pool.num_free:
                continue
            try:
                self.runner.step([StepItem(seq.table, seq.tokens[held:n], 1)])
            except Exception:  # the next turn computes them instead
                log.exception("pre-positioning failed")
                seq.table.truncate(held)
                continue
            seq.last_logits = None
            self.counters.ahead_tokens += n - held
            return True
        return False

    def _measure_prefill(self, items: list[StepItem], forward: float) -> None:
        tokens = sum(len(it.tokens) for it in items)
        if tokens >= 64:  # mostly prompt work: what recomputing a token costs
            per_token, old = forward / tokens, self.policy.prefill_s_per_token
            self.policy.prefill_s_per_token = per_token if old is None else 0.8 * old + 0.2 * per_token

    # -- admission, budget, preemption ----------------------------------

    def _reap(self) -> None:
        for req in [r for r in self.running + self.waiting if r.cancelled]:
            self.counters.cancelled += 1
            self._fail(req, RequestCancelledError("the request was cancelled"))
        timeout, now = self.limits.session_idle_timeout, time.monotonic()
        if timeout is not None and now - self._last_idle_check >= IDLE_CHECK_S:
            self._last_idle_check = now
            for seq in [s for s in self.sequences.all if not s.busy and now - s.idle_since >= timeout]:
                self.sequences.close(seq)

    def _schedule(self) -> list[_Work]:
        budget = self.limits.max_num_batched_tokens
        order = sorted(self.running + self.waiting, key=Request.priority)
        work: list[_Work] = []
        reserved = 0
        self._preempted_now.clear()
        for req in order:
            if len(work) >= self.limits.max_num_seqs:
                break
            if req.done.is_set() or req in self._preempted_now:  # gave way to another this step
                continue
            if not req.admitted and len(self.running) >= self.limits.max_num_seqs:
                continue  # no free slot: it waits
            if req.ready_logits is not None:
                work.append(self._admit(_Work(req, None, [])))
                continue
            if not req.admitted:
                if self._follows_a_prefill(req):
                    continue  # waits to match what another request is computing now
                if not self._find_kv(req, reserved, {x.req for x in work}) and work:
                    continue  # waits for room to restore the rest, rather than recompute it
            w = self._next_chunk(req)
            if len(w.item.tokens) > budget and work:
                continue  # waits for a step with room
            needed = reserved + w.item.table.pages_needed(len(w.item.tokens))
            if not self._secure(needed, req, {x.req for x in work}):
                if not work:  # nothing else could give way: it cannot run now
                    self._fail(req, KVCapacityError(needed, self.pool.num_free, self.pool.page_size))
                    continue
                break
            reserved = needed
            budget -= len(w.item.tokens)
            work.append(self._admit(w))
        return work

    def _follows_a_prefill(self, req: Request) -> bool:
        """Whether a running request is computing a prompt that shares more
        with req's tokens than it has computed yet: req then waits, and
        matches that prefix once computed (each prompt chunk is published to
        the prefix cache), instead of computing it a second time. Agents that
        start together share their system prompt this way."""
        seq = req.seq
        if self.policy.radix is None or seq.table.length:
            return False
        for r in self.running:
            other = r.seq
            held = other.table.length
            if (other is not seq and other.namespace == seq.namespace and held < len(other.tokens) - 1
                    and common_prefix_len(other.tokens, seq.tokens) > held + self.pool.page_size):
                return True
        return False

    def _find_kv(self, req: Request, reserved: int, scheduled: set[Request]) -> bool:
        """Before a request (re)joins: what of its sequence's KV the prefix
        cache and then the second tier still hold, all but the tokens it
        must compute for their logits. When the pool has no room for all the
        tier holds, as much as fits is restored; False then: the request
        should wait for the rest instead of computing it."""
        seq = req.seq
        limit = len(seq.tokens) - (req.num_logits if req.is_append else 1)
        self.policy.reuse_prefix(seq, limit)
        end = self.policy.restorable(seq, limit)
        if end <= seq.table.length:
            return True
        whole = self._secure(reserved + seq.table.pages_needed(end - seq.table.length), req, scheduled)
        if not whole:
            end = self._fits(seq, end, self.pool.num_free - reserved)
        if end > seq.table.length:
            restored = self.policy.restore(seq, end)
            if not req.started:
                seq.turn.restored_tokens += restored
        return whole

    def _fits(self, seq: Sequence, end: int, pages: int) -> int:
        """The furthest position up to end whose KV `pages` free pages can hold."""
        lo, hi = seq.table.length, end
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if seq.table.pages_needed(mid - seq.table.length) <= pages:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _next_chunk(self, req: Request) -> _Work:
        seq = req.seq
        held, n = seq.table.length, len(seq.tokens)
        size = self.limits.prefill_chunk
        end = min(n, (held // size + 1) * size)
        finishing = end == n
        draft = self._draft(req) if finishing and not req.is_append else []
        if req.is_append:  # logits of the appended tokens this chunk holds
            num_logits = max(1, end - max(held, n - req.num_logits))
        else:
            num_logits = len(draft) + 1
        item = StepItem(seq.table, seq.tokens[held:end] + draft, num_logits)
        return _Work(req, item, draft if finishing else None)

    def _admit(self, w: _Work) -> _Work:
        req, seq = w.req, w.req.seq
        if not req.admitted:
            req.admitted = True
            self.waiting.remove(req)
            self.running.append(req)
            if not req.started:  # first admission: what it found held or cached
                req.started = True
                c = self.counters
                c.queue_s.observe(time.monotonic() - req.queued_at)
                c.prefix_queries += len(seq.tokens)
                c.prefix_hits += seq.table.length
                if not seq.turn.computed_tokens:
                    seq.turn.prompt_tokens, seq.turn.reused_tokens = len(seq.tokens), seq.table.length
        return w

    def make_room(self, pages: int, soft_pins: bool = False) -> bool:
        """Apply the KV policy (engine.kv_policy) until `pages` are free,
        preempting nothing. Whether they are."""
        with self.lock:
            if self.pool.num_free >= pages:
                return True
            everyone = self.sequences.all
            return self.policy.make_room(pages, [s for s in everyone if not s.busy], soft_pins,
                                         frozenset(s.key for s in everyone if s.busy))

    def _secure(self, pages: int, req: Request, scheduled: set[Request]) -> bool:
        """Make `pages` free for req: the KV policy's idle pages first, then
        preemption of lower-priority requests holding pages, lowest first,
        then idle sessions still inside their pin time."""
        while not self.make_room(pages):
            victims = [r for r in self.running + self.waiting
                       if r not in scheduled and r is not req and r.priority() > req.priority() and r.seq.table.pages]
            if not victims:
                return self.make_room(pages, soft_pins=True)
            self._preempt(max(victims, key=Request.priority))
        return True

    def _preempt(self, req: Request) -> None:
        """Release req's pages (published to the prefix cache); its tokens and
        progress stay, and it re-queues to recompute what the cache loses.
        Its KV goes to the second tier when copying beats recomputing."""
        self.policy.evict(req.seq, preempted=True)
        req.ready_logits = None
        # An append's wanted logits are all recomputed: its prefix match stops before them.
        req.logits = []
        req.preemptions += 1
        self._preempted_now.add(req)
        self.counters.preemptions += 1
        if req.admitted:
            req.admitted = False
            self.running.remove(req)
            self.waiting.append(req)

    def _draft(self, req: Request) -> list[int]:
        seq = req.seq
        room = min(req.params.max_tokens - len(req.output), self.max_context - len(seq.tokens)) - 1
        if not req.speculative or room < 1 or not req.output:
            return []
        drafter = seq.draft_index(self.drafters.new)
        # What the grammar forces next comes first; prompt lookup continues after it.
        forced = req.grammar.forced()[:room] if req.grammar is not None and self.drafters.forced else []
        req.forced = len(forced)
        k = min(drafter.draft_len, room - len(forced))
        # Which tokens a seeded sample emits depends on what was drafted
        # (a draft token is accepted with probability p, a free draw is an
        # inverse CDF): drafting from other sessions' outputs would make a
        # seeded reply depend on them, so it drafts from its own session only.
        shared = req.params.greedy or req.params.seed is None
        if forced and k > 0:
            drafter.extend(forced)
            more = drafter.propose(k, shared)
            drafter.truncate(len(seq.tokens))
        else:
            more = drafter.propose(k, shared) if k > 0 else []
        draft = forced + more
        if req.grammar is None:
            return draft
        # A draft token the grammar forbids could never be accepted, nor anything after it.
        draft = req.grammar.clip(draft) if draft else draft
        phrases = req.grammar.grammar.phrases
        if k > 0 and phrases and self.drafters.schema and len(draft) <= len(forced):
            # Nothing allowed past the forced tokens: the rest of a schema name
            # the text has begun, the one the grammar lets through furthest.
            for rest in continuations(phrases, seq.tokens[-MAX_PHRASE_OVERLAP:] + forced, k):
                allowed = req.grammar.clip(forced + rest)
                if len(allowed) > len(draft):
                    draft = allowed
        return draft

    # -- results -------------------------------------------------------

    def _emit(self, work: list[_Work], rows: list, elapsed: float) -> None:
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
            results = verdicts(reqs, [r for _, r in finishing], drafts)
        except Exception as e:  # the batched verify itself: every finishing request
            results = [e] * len(reqs)
        for req, draft, v in zip(reqs, drafts, results):
            if isinstance(v, BaseException):
                self._fail(req, v)
                continue
            try:
                self._advance(req, draft, v.accepted, v.token)
            except Exception as e:  # a stream consumer, a grammar: this request's failure only
                self._fail(req, e)

    def _take_logits(self, w: _Work, rows) -> None:
        req, seq = w.req, w.req.seq
        # The rows are of the chunk's last positions, up to the table's end
        # (the runner has advanced it); keep those of appended tokens.
        first_row = seq.table.length - w.item.num_logits
        skip = max(0, len(seq.tokens) - req.num_logits - first_row)
        if skip < len(rows):
            req.logits.append(rows[skip:])
        if w.draft is not None:
            seq.last_logits = rows[-1]
            self._finish(req)

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
        if req.on_tokens is not None:
            req.on_tokens(new)
        if req.finish_reason is not None:
            seq.finish_reason = req.finish_reason
            self.drafters.finished(seq.namespace, req.output)
            self._file_turn(req)
            self._finish(req)

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
        tail = self.decode(out[-(max(map(len, stops)) + 8) :])
        return first_stop(tail, stops) is not None

    def _file_turn(self, req: Request) -> None:
        seq = req.seq
        self.policy.publish(seq)
        req.turn = seq.turn
        self.stats.append(seq.turn)
        for name, value in seq.turn.as_dict().items():
            self.turn_totals[name] = self.turn_totals.get(name, 0) + value
        seq.turn = TurnStats()

    def _finish(self, req: Request) -> None:
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)
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

    def _fail(self, req: Request, error: BaseException) -> None:
        if req.done.is_set():
            return
        seq = req.seq
        seq.rollback(req.start_len)
        seq.table.truncate(min(seq.table.length, req.start_held))
        req.error = error
        req.output = []
        req.logits = []
        self.counters.failed += 1
        self._finish(req)


def _phase(work: list[_Work]) -> str:
    """Name a step for the profiler timeline by the heaviest work in it."""
    if any(w.draft is None or (w.item is not None and len(w.item.tokens) > len(w.draft) + 1) for w in work):
        return "prefill"
    return "verify" if any(w.draft for w in work) else "decode"
