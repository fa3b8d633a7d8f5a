"""Which requests a step runs, and with what: admission, KV restore and
preemption.

A request whose program (engine.programs) holds no place waits for one:
programs are admitted whole, only while their KV fits. A step that would
otherwise have no work runs the first of them as a guest when its turn is
done before an admitted program is expected back, on pages none is due back
for.

Requests run in priority order (Request.priority: a conversation's next turn
by when the conversation began, then by arrival). A step takes, in that
order, what fits in its token budget, its sequence slots and the pool: a
prefill chunk, the one token drawn last step, or that token plus a
speculative draft. Before a request (re)joins, what the prefix cache and the
second tier still hold of its sequence is matched or restored. When pages run
short, idle KV gives way first, all of it if need be (engine.kv_policy:
unused cached prefixes, idle sequences past their pin, then those inside
it); only then is the lowest-priority request holding pages preempted: its
pages go (published to the prefix cache), its tokens stay, and it re-queues
to recompute what the cache lost. A preempted request is not preempted
again before it has made progress, unless nothing could run otherwise.

Prompt chunks end at multiples of Limits.prefill_chunk (and at the prompt's
end), so how a sequence is cut never depends on what shares its step.
"""
from __future__ import annotations

import time
from typing import Callable

from agentkv.cache.errors import KVCapacityError
from agentkv.cache.pool import PagePool
from agentkv.cache.tokens import common_prefix_len
from agentkv.engine.draft_planner import DraftPlanner
from agentkv.engine.kv_policy import KVPolicy
from agentkv.engine.limits import Limits
from agentkv.engine.programs import ProgramAdmission
from agentkv.engine.request import Request
from agentkv.engine.request_queue import RequestQueue
from agentkv.engine.sequence import Sequence, owner_of
from agentkv.engine.sequences import Sequences
from agentkv.engine.stats import STALLS, SchedulerCounters
from agentkv.engine.step_item import StepItem
from agentkv.engine.work import Work

Fail = Callable[[Request, BaseException], None]


class BatchPlanner:
    def __init__(self, pool: PagePool, policy: KVPolicy, sequences: Sequences, limits: Limits, queue: RequestQueue,
                 counters: SchedulerCounters, drafts: DraftPlanner, programs: ProgramAdmission, fail: Fail):
        self.pool, self.policy, self.sequences, self.limits = pool, policy, sequences, limits
        self.queue, self.counters, self.drafts, self.fail = queue, counters, drafts, fail
        self.programs = programs
        self._preempted_now: set[Request] = set()  # this step's: not scheduled again in it
        self._protect = True  # a request preempted before keeps its pages until it progresses
        self._blocked = False  # this pass left a request waiting for pages others hold
        self._held = False  # the last _secure kept pinned KV due back from its request
        self._wanted: frozenset[int] | None = None  # see make_room; found again each pass
        self._waited: set[str] = set()  # of STALLS: why this pass left requests waiting

    def plan(self) -> list[Work]:
        """This step's work, its requests admitted; a request that could
        never fit is failed (KVCapacityError)."""
        self._preempted_now.clear()
        self._wanted = None
        self._waited = set()
        self.programs.start_pass()
        work = self._plan()
        if not work and self._blocked:
            # Requests preempted before hold what the others need, and none
            # of them can run either: one gives way again rather than stall.
            self._protect = False
            work = self._plan()
            self._protect = True
        if not work and "admission" in self._waited:
            # The step would idle while programs wait for a place: the first runs as a guest.
            work = self._plan(guests=True)
        return work

    def _plan(self, guests: bool = False) -> list[Work]:
        budget = self.limits.max_num_batched_tokens
        work: list[Work] = []
        reserved = 0
        self._blocked = False
        for req in self.queue.by_priority():
            if len(work) >= self.limits.max_num_seqs:
                break
            if req.done.is_set() or req in self._preempted_now:  # gave way to another this step
                continue
            if not req.admitted and len(self.queue.running) >= self.limits.max_num_seqs:
                continue  # no free slot: it waits
            if not req.admitted and not self.programs.admit(req, guests):
                self._waited.add("admission")
                continue  # its program waits whole for room
            if req.ready_logits is not None:
                work.append(self._admit(Work(req, None, [])))
                continue
            if not req.admitted:
                if self._follows_a_prefill(req):
                    self._waited.add("prefix")
                    continue  # waits to match what another request is computing now
                if not self._find_kv(req, reserved, {x.req for x in work}) and work:
                    self._waited.add("restore")
                    continue  # waits for room to restore the rest, rather than recompute it
            w = self._next_chunk(req)
            if len(w.item.tokens) > budget and work:
                continue  # waits for a step with room
            needed = reserved + w.item.table.pages_needed(len(w.item.tokens))
            if not self._secure(needed, req, {x.req for x in work}):
                if work:
                    break
                if not self._held and not any(r is not req and r.seq.table.pages for r in self.queue.all()):
                    # Nothing else could give way: it cannot run now.
                    self.fail(req, KVCapacityError(needed, self.pool.num_free, self.pool.page_size))
                    continue
                self._blocked = True  # waits for pages others hold, while they run
                self._waited.add("pinned" if self._held else "pages")
                continue
            reserved = needed
            budget -= len(w.item.tokens)
            work.append(self._admit(w))
        return work

    def stall(self) -> str | None:
        """Why the last plan left requests waiting, the first of STALLS that applies."""
        return next((w for w in STALLS if w in self._waited), None)

    def make_room(self, pages: int, soft_pins: bool = False) -> bool:
        """Apply the KV policy (engine.kv_policy) until `pages` are free,
        preempting nothing. Whether they are. The caller holds the lock."""
        self._wanted = None
        return self._make_room(pages, soft_pins) or (soft_pins and self.policy.last_resort(pages))

    def _guest(self, req: Request) -> bool:
        return not self.programs.placed(req.seq.key)

    def _make_room(self, pages: int, soft_pins: bool, hold: frozenset[Sequence] = frozenset()) -> bool:
        if self.pool.num_free >= pages:
            return True
        everyone = self.sequences.all
        if self._wanted is None:
            # What requests waiting for their program's place will reuse from
            # the prefix cache: due back, it goes after idle sessions past
            # their pin. Found once a pass (plan resets it): a long queue's
            # matches then cost a step little.
            self._wanted = frozenset(p for r in self.queue.all() if self.programs.waits(r)
                                     for p in self.policy.cached_prefix(r.seq)[1])
        idle = [s for s in everyone if not s.busy]
        # A guest's idle KV (its program holds no place) goes with what is past its pin.
        unplaced = frozenset(s for s in idle if not self.programs.placed(s.key))
        return self.policy.make_room(pages, idle, soft_pins, frozenset(s.key for s in everyone if s.busy),
                                     self._wanted, hold, unplaced)

    def _outranking(self, req: Request) -> frozenset[Sequence]:
        """The pinned idle sequences req's work waits for rather than take
        their pages: those whose program holds its place, due back closer
        than their bring-back cost (KVPolicy.worth_waiting_for); for a
        request holding a place, only an older conversation's of its
        tenant. Programs are served first come, first served; a paused one
        is still being served, and a guest runs on what they leave. Other
        tenants' pins give way by their share (KVPolicy). Stepped inline,
        nothing comes back while the caller waits: nothing is held."""
        if not (self.programs.enabled and self.programs.expect_returns):
            return frozenset()
        now, owner, guest = time.monotonic(), owner_of(req.seq.namespace), self._guest(req)
        return frozenset(s for s in self.sequences.all
                         if not s.busy and s.table.pages and s.pin_ttl is not None and self.programs.placed(s.key)
                         and (guest or (s.arrival < req.seq.arrival and owner_of(s.namespace) == owner))
                         and self.policy.worth_waiting_for(s, now))

    def _follows_a_prefill(self, req: Request) -> bool:
        """Whether a running request is computing a prompt that shares more
        with req's tokens than it has computed yet: req then waits, and
        matches that prefix once computed (each prompt chunk is published to
        the prefix cache), instead of computing it a second time. Agents that
        start together share their system prompt this way."""
        seq = req.seq
        if self.policy.radix is None or seq.table.length:
            return False
        for r in self.queue.running:
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

    def _next_chunk(self, req: Request) -> Work:
        seq = req.seq
        held, n = seq.table.length, len(seq.tokens)
        size = self.limits.prefill_chunk
        end = min(n, (held // size + 1) * size)
        finishing = end == n
        draft = self.drafts.draft(req) if finishing and not req.is_append else []
        if req.is_append:  # logits of the appended tokens this chunk holds
            num_logits = max(1, end - max(held, n - req.num_logits))
        else:
            num_logits = len(draft) + 1
        item = StepItem(seq.table, seq.tokens[held:end] + draft, num_logits)
        return Work(req, item, draft if finishing else None)

    def _admit(self, w: Work) -> Work:
        req, seq = w.req, w.req.seq
        if not req.admitted:
            self.queue.admit(req)
            if not req.started:  # first admission: what it found held or cached
                req.started = True
                c = self.counters
                seq.turn.queued_s = time.monotonic() - req.queued_at
                c.queue_s.observe(seq.turn.queued_s)
                c.prefix_queries += len(seq.tokens)
                c.prefix_hits += seq.table.length
                if not seq.turn.computed_tokens:
                    seq.turn.prompt_tokens, seq.turn.reused_tokens = len(seq.tokens), seq.table.length
        return w

    def _secure(self, pages: int, req: Request, scheduled: set[Request]) -> bool:
        """Make `pages` free for req: idle KV first, down to the sessions still
        inside their pin (the KV policy's order), and only then preemption of
        lower-priority requests holding pages, lowest first."""
        if self.pool.num_free >= pages:
            return True
        hold = self._outranking(req)
        self._held = bool(hold)  # req may wait for them rather than fail
        while not self._make_room(pages, True, hold):
            victim = self._victim(req, scheduled)
            if victim is None:
                # req waits: for pinned KV due back, or for a request protected
                # from preemption (it may give way on the step's second pass,
                # plan). The tree goes only when nothing else can.
                if hold or self._victim_later(req, scheduled):
                    return False
                return self.policy.last_resort(pages)
            self._preempt(victim)
        return True

    def _victim(self, req: Request, scheduled: set[Request]) -> Request | None:
        """A request whose program waits for its place, holding pages (its
        session's KV, which a turn's fork carries), whatever its priority:
        it cannot run before the admitted programs make room, so holding them
        it would stall both; then a guest's, for a request holding a place.
        Else the lowest-priority request below req holding pages. A guest
        preempts only guests; a guest, like any request, preempted before
        gives way again only once it has progressed since (unless the step
        would stall otherwise: see plan)."""
        holders, guest = self._holders(req, scheduled), self._guest(req)
        if guest:
            holders = [r for r in holders if self._guest(r)]
        stalled = [r for r in holders if self.programs.waits(r)]
        if self._protect:
            holders = [r for r in holders if r.progress() > r.progress_at_preemption]
        if not guest:
            stalled = stalled or [r for r in holders if self._guest(r)]
        if stalled:
            return max(stalled, key=Request.priority)
        return max((r for r in holders if r.priority() > req.priority()), key=Request.priority, default=None)

    def _victim_later(self, req: Request, scheduled: set[Request]) -> bool:
        """Whether a request protected this pass could give way on the second."""
        return self._protect and any(r.priority() > req.priority() for r in self._holders(req, scheduled))

    def _holders(self, req: Request, scheduled: set[Request]) -> list[Request]:
        return [r for r in self.queue.all() if r not in scheduled and r is not req and r.seq.table.pages]

    def _preempt(self, req: Request) -> None:
        """Release req's pages (published to the prefix cache); its tokens and
        progress stay, and it re-queues to recompute what the cache loses.
        Its KV goes to the second tier when copying beats recomputing."""
        self.policy.evict(req.seq, preempted=True)
        req.ready_logits = None
        # An append's wanted logits are all recomputed: its prefix match stops before them.
        req.logits = []
        if req.preemptions:
            self.counters.repeat_preemptions += 1
        req.preemptions += 1
        req.progress_at_preemption = req.progress()
        # Its program gives up its place: it comes back whole, when it fits.
        self.programs.evict(req.seq.key)
        self._preempted_now.add(req)
        self.counters.preemptions += 1
        self.queue.requeue(req)
