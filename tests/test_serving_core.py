"""The serving core: a waiting queue, admission, preemption instead of
failure, cancellation, failure that stays local, bounded state and work that
is really batched. The reference for every output is the same request run
alone on an engine with room to spare."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from agentkv import Engine, KVCapacityError
from agentkv.engine.errors import PoolTooSmallError, QueueFullError, RequestCancelledError, TooManySessionsError
from agentkv.engine.limits import Limits
from tests.conftest import assert_all_pages_free
from tests.hf_models import make_hf_model

PS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("core")
    make_hf_model("llama-gqa-llama3rope-tied", path, seed=11)
    return path


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(ckpt, prompt: list[int], max_tokens: int, speculative: bool = True) -> list[int]:
    """The reference: one request on an engine of its own, nothing cached."""
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=512, prefix_cache=False)
    with engine.session() as s:
        s.queue(prompt)
        return s.generate(max_tokens=max_tokens, ignore_eos=True, speculative=speculative)


def test_concurrent_clients_are_batched_and_match_one_at_a_time(ckpt):
    prompts = [ids(9 + 5 * i, 100 + i) for i in range(6)]
    expected = [alone(ckpt, p, 12) for p in prompts]
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=256)
    results, errors = [None] * len(prompts), []
    barrier = threading.Barrier(len(prompts))

    def client(i: int) -> None:
        try:
            barrier.wait()
            with engine.session() as s:
                s.queue(prompts[i])
                req = s.start_generate(max_tokens=12, ignore_eos=True)
                assert req.done.wait(120)
                results[i] = req.output
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    # The loop starts once every client has submitted, so that batching is
    # certain however the threads are scheduled.
    for _ in range(3000):
        if engine.scheduler.in_flight == len(prompts):
            break
        time.sleep(0.01)
    engine.scheduler.start()
    try:
        for t in threads:
            t.join(120)
    finally:
        engine.scheduler.stop()
    assert not errors and results == expected
    counts = engine.scheduler.counters.batch_size.counts
    assert sum(counts[1:]) > 0, "no step ever held more than one sequence"
    assert_all_pages_free(engine)


def test_logits_do_not_depend_on_what_shares_the_step_or_where_the_pages_sit(ckpt):
    """fp32: bit for bit, so that reruns of an ablation agree (see docs/architecture.md)."""
    x, more = ids(37, 30), ids(9, 31)

    def engine() -> Engine:
        return Engine.from_pretrained(ckpt, page_size=PS, num_pages=128, prefix_cache=False,
                                      limits=Limits(prefill_chunk=8, max_num_batched_tokens=64))

    alone = engine()
    with alone.session() as s:
        want = s.append(x, all_logits=True)
        want_gen = s.generate(max_tokens=6, ignore_eos=True, speculative=False)
        want_more = s.append(more, all_logits=True)
    busy = engine()
    # Scatter the free pages: fill the pool with small sessions, then close every other one.
    fillers = [busy.session() for _ in range(20)]
    for i, f in enumerate(fillers):
        f.append(ids(4 * (1 + i % 3), 40 + i))
    for f in fillers[::2]:
        f.close()
    # Others prefill and decode in the same steps.
    others = [busy.session() for _ in range(3)]
    reqs = []
    for i, o in enumerate(others):
        o.queue(ids(11 + 13 * i, 50 + i))
        reqs.append(o.start_generate(max_tokens=30, ignore_eos=True))
    busy.scheduler.step()
    with busy.session() as s:
        got = s.append(x, all_logits=True)
        got_gen = s.generate(max_tokens=6, ignore_eos=True, speculative=False)
        got_more = s.append(more, all_logits=True)
        pages = list(s.table.pages)
    for r in reqs:
        busy.scheduler.wait(r)
    assert any(b != a + 1 for a, b in zip(pages, pages[1:])), "the pages did land scattered"
    assert sum(busy.scheduler.counters.batch_size.counts[1:]) > 0
    assert torch.equal(got, want) and got_gen == want_gen and torch.equal(got_more, want_more)
    for o in fillers[1::2] + others:
        o.close()


def test_pool_smaller_than_the_working_set_queues_and_preempts_instead_of_failing(ckpt):
    # 8 requests of ~40 tokens each need ~80 pages of 4; the pool holds 30.
    prompts = [ids(20 + i, 200 + i) for i in range(8)]
    expected = [alone(ckpt, p, 20) for p in prompts]
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=30, limits=Limits(max_num_batched_tokens=32, prefill_chunk=8))
    sessions = [engine.session() for _ in prompts]
    reqs = []
    for s, p in zip(sessions, prompts):
        s.queue(p)
        reqs.append(s.start_generate(max_tokens=20, ignore_eos=True))
    for r in reqs:
        engine.scheduler.wait(r)
    assert [r.error for r in reqs] == [None] * len(reqs)
    assert [r.output for r in reqs] == expected
    assert engine.scheduler.counters.preemptions > 0
    for s in sessions:
        s.close()
    assert_all_pages_free(engine)


def test_an_append_preempted_midway_returns_every_logit_once(ckpt):
    tokens = ids(40, 20)
    ref_engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64, prefix_cache=False)
    with ref_engine.session() as ref:
        expected = ref.append(tokens, all_logits=True)
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=14, limits=Limits(prefill_chunk=4))
    older = engine.session()  # an earlier conversation: its turn goes first
    older.queue(ids(30, 21))
    s = engine.session()
    req = s.start_append(tokens, all_logits=True)
    for _ in range(4):
        engine.scheduler.step()
    assert 0 < s.table.length < 40
    first = older.start_generate(max_tokens=16, ignore_eos=True)  # needs most of the pool
    engine.scheduler.wait(first)
    engine.scheduler.wait(req)
    assert req.preemptions >= 1 and first.error is None and req.error is None
    got = torch.cat(req.logits)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    older.close()
    s.close()


def test_a_prompt_larger_than_the_pool_is_refused_at_once_and_changes_nothing(ckpt):
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=10)
    s = engine.session()
    s.append(ids(8, 1))
    before = (s.tokens, list(s.table.pages), engine.pool.num_free, engine.scheduler.in_flight)
    with pytest.raises(PoolTooSmallError):
        s.append(ids(40, 2))  # 48 tokens: 12 pages of a pool of 10
    s.queue(ids(40, 3))
    with pytest.raises(PoolTooSmallError):
        s.generate(max_tokens=2)
    s.truncate(8)
    assert (s.tokens, list(s.table.pages), engine.pool.num_free, engine.scheduler.in_flight) == before
    s.close()


def test_a_full_queue_refuses_and_changes_nothing(ckpt):
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64, limits=Limits(max_queue=2))
    sessions = [engine.session() for _ in range(3)]
    for s in sessions:
        s.queue(ids(6, 4))
    first = [s.start_generate(max_tokens=3, ignore_eos=True) for s in sessions[:2]]
    with pytest.raises(QueueFullError):
        sessions[2].start_generate(max_tokens=3, ignore_eos=True)
    assert not sessions[2].busy and len(sessions[2]) == 6 and engine.scheduler.in_flight == 2
    for r in first:
        engine.scheduler.wait(r)
    assert len(sessions[2].generate(max_tokens=3, ignore_eos=True)) == 3
    for s in sessions:
        s.close()


def test_cancel_rolls_back_within_a_step(ckpt):
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64)
    s, other = engine.session(), engine.session()
    s.append(ids(10, 5))
    other.queue(ids(12, 6))
    before = (s.tokens, list(s.table.pages), s.table.length)
    req = s.start_generate(max_tokens=50, ignore_eos=True)
    bystander = other.start_generate(max_tokens=8, ignore_eos=True)
    for _ in range(3):
        engine.scheduler.step()
    assert len(req.output) >= 2
    req.cancel()
    steps = engine.scheduler.counters.steps
    engine.scheduler.step()
    assert req.done.is_set() and isinstance(req.error, RequestCancelledError) and req.output == []
    assert engine.scheduler.counters.steps == steps + 1  # that step served the bystander only
    assert (s.tokens, list(s.table.pages), s.table.length) == before
    engine.scheduler.wait(bystander)
    assert bystander.error is None and len(bystander.output) == 8
    s.close()
    other.close()
    assert_all_pages_free(engine)


def test_a_failing_grammar_fails_only_its_own_request(ckpt, monkeypatch):
    from agentkv.engine.grammar import GrammarState

    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64)
    good, bad = engine.session(), engine.session()
    good.queue(ids(10, 7))
    bad.queue(ids(10, 8))

    class Broken(GrammarState):
        def __init__(self):
            self.calls = 0

        def clip(self, draft):
            return draft

        def fill_bitmask(self, bitmask, offset, draft):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("grammar engine fault")

        def accept(self, token):
            return True

        @property
        def terminated(self):
            return False

    before = (bad.tokens, bad.table.length)
    r_good = good.start_generate(max_tokens=6, ignore_eos=True)
    r_bad = bad.start_generate(max_tokens=6, ignore_eos=True, speculative=False)
    r_bad.grammar = Broken()
    for r in (r_good, r_bad):
        engine.scheduler.wait(r)
    assert isinstance(r_bad.error, RuntimeError) and (bad.tokens, bad.table.length) == before
    assert r_good.error is None and r_good.output == alone(ckpt, ids(10, 7), 6)
    good.close()
    bad.close()
    assert_all_pages_free(engine)


def test_a_step_that_fails_whole_fails_its_requests_and_the_loop_goes_on(ckpt, monkeypatch):
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64)
    engine.scheduler.start()
    try:
        s = engine.session()
        s.queue(ids(10, 9))
        real = engine.runner.step
        monkeypatch.setattr(engine.runner, "step", lambda items: (_ for _ in ()).throw(RuntimeError("device lost")))
        with pytest.raises(RuntimeError, match="device lost"):
            s.generate(max_tokens=4, ignore_eos=True)
        assert len(s) == 10 and not s.busy
        monkeypatch.setattr(engine.runner, "step", real)
        assert s.generate(max_tokens=4, ignore_eos=True) == alone(ckpt, ids(10, 9), 4)
        assert engine.scheduler.serving
    finally:
        engine.scheduler.stop()
    s.close()
    assert_all_pages_free(engine)


def test_a_lone_request_that_outgrows_the_pool_fails_typed_and_rolls_back(ckpt):
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=8)
    s = engine.session()
    s.append(ids(20, 10))
    before = (s.tokens, list(s.table.pages))
    with pytest.raises(KVCapacityError):
        s.generate(max_tokens=30, ignore_eos=True)  # 50 tokens: 13 pages of 8
    assert (s.tokens, list(s.table.pages)) == before
    s.close()


def test_the_session_limit_refuses_and_closes_nothing_and_idle_timeout_closes(ckpt, monkeypatch):
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64,
                                    limits=Limits(max_sessions=2, session_idle_timeout=60.0, max_stats=3))
    a, b = engine.session(), engine.session()
    a.append(ids(5, 11))
    b.append(ids(5, 12))
    held, free = [(s.tokens, list(s.table.pages)) for s in (a, b)], engine.pool.num_free
    with pytest.raises(TooManySessionsError, match="limit of 2 live sessions"):
        engine.session()
    with pytest.raises(TooManySessionsError):
        a.fork()
    assert [(s.tokens, list(s.table.pages)) for s in (a, b)] == held and engine.pool.num_free == free
    work = a.fork_for_turn()  # a turn's working fork does not count
    work.append([1])
    a.adopt(work)
    assert len(a) == 6
    a.close()
    c = engine.session()  # a closed session makes room
    for _ in range(5):
        b.generate(max_tokens=1, ignore_eos=True)
    assert len(engine.stats) == 3  # a bounded ring
    import agentkv.engine.scheduler as sched_module

    now = time.monotonic()
    monkeypatch.setattr(sched_module.time, "monotonic", lambda: now + 61.0)
    engine.scheduler.step()
    assert b.closed and c.closed
    engine.radix.clear()
    assert engine.pool.num_free == engine.pool.num_pages


def test_kept_sessions_are_parked_by_the_idle_timeout(ckpt, monkeypatch):
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64, limits=Limits(session_idle_timeout=60.0))
    kept, plain = engine.session(), engine.session()
    kept.keep()
    kept.append(ids(9, 11))
    plain.append(ids(5, 12))
    import agentkv.engine.scheduler as sched_module

    now = time.monotonic()
    monkeypatch.setattr(sched_module.time, "monotonic", lambda: now + 61.0)
    engine.scheduler.step()
    assert plain.closed and not kept.closed and not kept.table.pages and len(kept) == 9
    computed = kept.turn.computed_tokens
    kept.append(ids(3, 13))  # its prefix comes back from the prefix cache: only the new tokens are computed
    assert kept.table.length == 12 and kept.turn.computed_tokens == computed + 3
    kept.close()
    engine.radix.clear()
    assert engine.pool.num_free == engine.pool.num_pages
