"""Continuous batching over the sequences the scheduler owns: the loop and
the queue.

Requests wait in one queue (engine.request_queue). Each step, the batch
planner takes what fits (engine.batch_planner: admission, KV restore,
preemption; engine.draft_planner: the drafts), one forward runs it
(engine.runner), and the output processor turns its rows into tokens, stops
and finished turns (engine.output_processor: one batched verify and sample).
A request's failure fails that request only, rolled back; a failure of the
whole forward fails that step's requests, and the loop goes on. Observers
(engine.step_observer) watch each step, draft and verdict.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Iterable

from agentkv.cache.pool import PagePool
from agentkv.engine.batch_planner import BatchPlanner
from agentkv.engine.draft_planner import DraftPlanner
from agentkv.engine.errors import EngineError, PoolTooSmallError, QueueFullError, RequestCancelledError, SessionClosedError
from agentkv.engine.kv_policy import KVPolicy
from agentkv.engine.limits import Limits
from agentkv.engine.openmp_pool import release_openmp_pool
from agentkv.engine.output_processor import OutputProcessor
from agentkv.engine.programs import ProgramAdmission
from agentkv.engine.request import Request
from agentkv.engine.request_queue import RequestQueue
from agentkv.engine.runner import ModelRunner
from agentkv.engine.sequence import Sequence
from agentkv.engine.sequences import Sequences
from agentkv.engine.stats import SchedulerCounters, TurnStats
from agentkv.engine.step_item import StepItem
from agentkv.engine.step_observer import Observers, StepObserver
from agentkv.engine.trace import span
from agentkv.engine.work import step_phase
from agentkv.model.sampler import make_generator
from agentkv.spec.drafters import Drafters

log = logging.getLogger("agentkv.scheduler")

# How often idle sessions are checked against the idle timeout.
IDLE_CHECK_S = 1.0


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
        programs: ProgramAdmission | None = None,
    ):
        self.runner, self.pool, self.policy, self.limits = runner, pool, policy, limits
        self.sequences = sequences
        sequences.on_close = self._fail_requests_of
        # The sequences' lock: also held by each step.
        self.lock = sequences.lock
        self.eos_token_ids = frozenset(eos_token_ids)
        self.drafters = drafters or Drafters()
        self.counters = SchedulerCounters()
        self.queue = RequestQueue()
        self.observers = Observers()
        self.outputs = OutputProcessor(pool, policy, self.queue, self.drafters, self.counters, self.observers,
                                       max_context, limits.max_stats, decode)
        # Programs admitted whole while their KV fits (engine.programs); without one, every request is.
        self.programs = programs or ProgramAdmission(0, pool.page_size, sequences.family, enabled=False)
        self.planner = BatchPlanner(pool, policy, sequences, limits, self.queue, self.counters,
                                    DraftPlanner(self.drafters, max_context, self.observers), self.programs,
                                    self.outputs.fail)
        self._last_idle_check = time.monotonic()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def waiting(self) -> list[Request]:
        """Requests queued, or preempted and queued again."""
        return self.queue.waiting

    @property
    def running(self) -> list[Request]:
        """Requests admitted since they last queued."""
        return self.queue.running

    @property
    def stats(self) -> deque[TurnStats]:
        """The latest finished turns."""
        return self.outputs.stats

    @property
    def turn_totals(self) -> dict[str, float]:
        """Every finished turn's stats, summed."""
        return self.outputs.turn_totals

    def add_observer(self, observer: StepObserver) -> None:
        """observer's hooks are called from the next step on."""
        with self.lock:
            self.observers.add(observer)

    def remove_observer(self, observer: StepObserver) -> None:
        with self.lock:
            self.observers.remove(observer)

    def _fail_requests_of(self, seq: Sequence) -> None:
        for req in [r for r in self.queue.all() if r.seq is seq]:
            self.outputs.fail(req, SessionClosedError("the session was closed"))

    # -- requests ------------------------------------------------------

    def submit(self, req: Request, tokens: list[int] = ()) -> None:
        """Queue req after appending tokens to its sequence. Raises (and
        changes nothing) if the session is busy or closed, the queue is full,
        or the sequence could never fit in the pool."""
        with self.sequences.idle(req.seq):
            seq = req.seq
            if len(self.queue.waiting) >= self.limits.max_queue:
                raise QueueFullError(f"{len(self.queue.waiting)} requests are waiting, the most this server queues")
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
            req.queued_at = time.monotonic()
            self.policy.retention.resumed(seq, req.queued_at)
            if self.policy.tier is not None and seq.table.length < len(seq.tokens) - 1:
                self.policy.tier.prefetch(seq.key)
            seq.busy = True
            self.queue.push(req)
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
        return len(self.queue)

    # -- the loop ------------------------------------------------------

    @property
    def serving(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Step in a background thread, so that requests from many callers share each forward."""
        if self.serving:
            return
        # The caller's OpenMP workers (it loaded the model or stepped inline) would idle beside the
        # loop's and slow every step the loop runs (engine.openmp_pool).
        release_openmp_pool()
        self.programs.expect_returns = True
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
            self.programs.expect_returns = False
        with self.lock:
            for req in self.queue.all():
                self.outputs.fail(req, EngineError("the scheduler stopped before the request finished"))

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
                    for req in self.queue.all():
                        self.outputs.fail(req, e)
                busy = False
            if not busy:
                stall = self.planner.stall() if len(self.queue) else None
                idle_from = time.perf_counter()
                self._wake.wait(0.05)
                self._wake.clear()
                if stall is not None:
                    self.counters.stalled_s[stall] += time.perf_counter() - idle_from

    def step(self) -> bool:
        """One step; whether it did any work."""
        with self.lock:
            return self._step()

    def _step(self) -> bool:
        start = time.perf_counter()
        self._reap()
        work = self.planner.plan()
        if not work:
            return self._compute_prepositioned()
        items = [w.item for w in work if w.item is not None]
        logits = []
        phase = step_phase(work)
        forward_start = time.perf_counter()
        if items:
            try:
                with span(phase):
                    logits = self.runner.step(items)
            except Exception as e:  # the whole step failed: so do its requests, and nothing else
                for w in work:
                    self.outputs.fail(w.req, e)
                return True
        forward = time.perf_counter() - forward_start
        if items and self.observers:
            self.observers.step(phase, items, forward)
        self._measure_prefill(items, forward)
        rows = iter(logits)
        self.outputs.emit(work, [next(rows) if w.item is not None else w.req.ready_logits for w in work], forward)
        c = self.counters
        c.steps += 1
        c.batch_size.observe(len(work))
        c.forward_s += forward
        c.step_s += time.perf_counter() - start
        return True

    def _compute_prepositioned(self) -> bool:
        """With nothing else to do: compute the pending tokens of one idle
        sequence that holds them ahead of its next turn (pre-positioning),
        within this step and under the lock, so the sequence never looks
        busy. Only into free pages and while no request waits: nothing is
        evicted or delayed for it; what is not computed here, the next turn
        computes."""
        if len(self.queue):
            return False
        for seq in self.sequences.all:
            if not seq.preposition_pending or seq.busy or seq.closed:
                continue
            seq.preposition_pending = False
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
            self.counters.prepositioned_tokens += n - held
            return True
        return False

    def _measure_prefill(self, items: list[StepItem], forward: float) -> None:
        tokens = sum(len(it.tokens) for it in items)
        if tokens >= 64:  # mostly prompt work: what recomputing a token costs
            per_token, old = forward / tokens, self.policy.prefill_s_per_token
            self.policy.prefill_s_per_token = per_token if old is None else 0.8 * old + 0.2 * per_token

    def _reap(self) -> None:
        self.sequences.close_dropped()
        for req in [r for r in self.queue.all() if r.cancelled]:
            self.counters.cancelled += 1
            self.outputs.fail(req, RequestCancelledError("the request was cancelled"))
        timeout, now = self.limits.session_idle_timeout, time.monotonic()
        if timeout is not None and now - self._last_idle_check >= IDLE_CHECK_S:
            self._last_idle_check = now
            for seq in [s for s in self.sequences.all if not s.busy and now - s.idle_since >= timeout]:
                if not seq.kept:
                    self.sequences.close(seq)
                elif seq.table.pages:  # its record's next turn restores or recomputes it
                    self.policy.evict(seq, family_busy=any(s.busy for s in self.sequences.family(seq.key)))

    def make_room(self, pages: int, soft_pins: bool = False) -> bool:
        """Apply the KV policy (engine.kv_policy) until `pages` are free,
        preempting nothing. Whether they are."""
        with self.lock:
            return self.planner.make_room(pages, soft_pins)
