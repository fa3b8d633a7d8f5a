"""The scheduler under random traffic (hypothesis state machine): several
sessions submit, append, fork, truncate, cancel and close while a pool small
enough to force queueing and preemption serves them. After every rule the
page accounting holds and every request is queued, running or done exactly
once; at the end every request is done, each greedy generation equals the
same request run alone on an engine with room, and the only requests that
failed are those cancelled or whose session was closed: pressure alone
(queueing, preemption) never fails one."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from agentkv import Engine
from agentkv.engine.errors import EngineError, KVCapacityError, RequestCancelledError, SessionClosedError
from agentkv.engine.limits import Limits
from tests.hf_models import make_hf_model

PS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("machine")
    make_hf_model("llama-gqa-llama3rope-tied", path, seed=13)
    return path


def test_scheduler_state_machine(ckpt):
    reference = Engine.from_pretrained(ckpt, page_size=PS, num_pages=512, prefix_cache=False)
    cache: dict[tuple, list[int]] = {}
    seen = {"finished": 0, "preemptions": 0, "batched_steps": 0}

    def alone(prompt: list[int], max_tokens: int, speculative: bool) -> list[int]:
        key = (tuple(prompt), max_tokens, speculative)
        if key not in cache:
            with reference.session() as s:
                s.queue(prompt)
                cache[key] = s.generate(max_tokens=max_tokens, ignore_eos=True, speculative=speculative)
        return cache[key]

    class Traffic(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            limits = Limits(max_num_seqs=3, max_num_batched_tokens=12, prefill_chunk=4, max_queue=6)
            self.engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=20, pin_ttl=0.0, limits=limits)
            self.sessions = []
            self.requests = []  # (request, prompt, max_tokens, speculative)
            self.session_of = {}  # request -> its session
            self.cancelled = set()

        def idle(self):
            return [s for s in self.sessions if not s.closed and not s.busy]

        @initialize(lengths=st.lists(st.integers(10, 30), min_size=3, max_size=3), seed=st.integers(0, 10**6))
        def busy_start(self, lengths, seed):
            for i, n in enumerate(lengths):
                self.new_session(n, seed + i)
                self.submit(i, 12, i % 2 == 0, [])

        @rule(n=st.integers(1, 30), seed=st.integers(0, 10**6))
        def new_session(self, n, seed):
            if len([s for s in self.sessions if not s.closed]) < 5:
                s = self.engine.session()
                s.queue(torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist())
                self.sessions.append(s)

        @precondition(lambda self: self.idle())
        @rule(i=st.integers(0, 99), max_tokens=st.integers(1, 16), speculative=st.booleans(),
              extra=st.lists(st.integers(0, 319), max_size=6))
        def submit(self, i, max_tokens, speculative, extra):
            s = self.idle()[i % len(self.idle())]
            if extra:
                s.queue(extra)
            try:
                req = s.start_generate(max_tokens=max_tokens, ignore_eos=True, speculative=speculative)
            except EngineError:  # a full queue, a sequence beyond the pool: refused, nothing changed
                return
            self.requests.append((req, s.tokens, max_tokens, speculative))
            self.session_of[req] = s

        @precondition(lambda self: self.idle())
        @rule(i=st.integers(0, 99), n=st.integers(1, 8))
        def append(self, i, n):
            s = self.idle()[i % len(self.idle())]
            before = s.tokens
            try:
                s.append(list(range(n)))
            except (EngineError, KVCapacityError):
                assert s.tokens == before

        @precondition(lambda self: self.idle())
        @rule(i=st.integers(0, 99))
        def fork(self, i):
            if len([s for s in self.sessions if not s.closed]) < 5:
                self.sessions.append(self.idle()[i % len(self.idle())].fork())

        @precondition(lambda self: self.idle())
        @rule(i=st.integers(0, 99), cut=st.integers(0, 40))
        def truncate(self, i, cut):
            s = self.idle()[i % len(self.idle())]
            s.truncate(min(cut, len(s)))

        @precondition(lambda self: any(not r.done.is_set() for r, *_ in self.requests))
        @rule(i=st.integers(0, 99))
        def cancel(self, i):
            if i % 3:  # rarer than the rest, so that requests get to run
                return
            live = [r for r, *_ in self.requests if not r.done.is_set()]
            live[i % len(live)].cancel()
            self.cancelled.add(live[i % len(live)])

        @precondition(lambda self: any(not s.closed for s in self.sessions))
        @rule(i=st.integers(0, 99))
        def close(self, i):
            if i % 3:
                return
            live = [s for s in self.sessions if not s.closed]
            live[i % len(live)].close()

        @rule(n=st.integers(1, 8))
        def step(self, n):
            for _ in range(n):
                self.engine.scheduler.step()

        @invariant()
        def accounting(self):
            self.engine.pool.check()
            sched = self.engine.scheduler
            queued = sched.running + sched.waiting
            assert len(queued) == len(set(queued))
            for req, *_ in self.requests:
                assert req.done.is_set() != (req in queued)
            assert len(sched.running) <= 3

        def teardown(self):
            sched = self.engine.scheduler
            for _ in range(2000):
                if not sched.in_flight:
                    break
                sched.step()
            assert not sched.in_flight
            for req, prompt, max_tokens, speculative in self.requests:
                assert req.done.is_set()
                if req.error is None:
                    assert len(req.output) == max_tokens
                    assert req.output == alone(prompt, max_tokens, speculative)
                elif isinstance(req.error, RequestCancelledError):
                    assert req in self.cancelled, req.error
                else:
                    assert isinstance(req.error, SessionClosedError) and self.session_of[req].closed, req.error
            seen["finished"] += sum(r.error is None for r, *_ in self.requests)
            seen["preemptions"] += sched.counters.preemptions
            seen["batched_steps"] += sum(sched.counters.batch_size.counts[1:])
            for s in self.sessions:
                s.close()
            self.engine.radix.clear()
            assert self.engine.pool.num_free == self.engine.pool.num_pages

    Traffic.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None, derandomize=True,
                                         suppress_health_check=list(HealthCheck))
    Traffic.TestCase().runTest()
    # The traffic really queued, preempted and batched.
    assert seen["finished"] > 0 and seen["preemptions"] > 0 and seen["batched_steps"] > 0, seen
