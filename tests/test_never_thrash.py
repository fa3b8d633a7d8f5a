"""Many agents under KV pressure: running work is never thrown away to keep
idle KV, a preempted request is not preempted again before it makes
progress, and programs (a session's turns) are admitted whole only while
their KV fits, queued rather than thrashed."""
from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentkv import Engine
from agentkv.engine.limits import Limits
from agentkv.engine.programs import BACKFILL_WAIT_S
from agentkv.engine.retention import RetentionConfig
from tests.hf_models import make_hf_model
from tests.test_kv_tier import ids

PS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("thrash")
    make_hf_model("llama-gqa-llama3rope-tied", path, seed=7)
    return path


@pytest.fixture(scope="module")
def roomy(ckpt):
    return Engine.from_pretrained(ckpt, page_size=PS, num_pages=1024, prefix_cache=False)


def alone(roomy: Engine, turns: list[list[int]], gen: int) -> list[list[int]]:
    """Each turn's greedy reply, the program run by itself with room to spare."""
    out = []
    with roomy.session() as s:
        for delta in turns:
            s.queue(delta)
            out.append(s.generate(max_tokens=gen, ignore_eos=True, speculative=False))
    return out


def test_running_work_is_never_preempted_while_idle_pinned_kv_holds_pages(ckpt):
    # The pool: 40 pages. Two idle sessions inside long tool pins hold 10 each;
    # an older conversation's generation needs more than what is left.
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=40, prefix_cache=False, program_admission=False,
                                    kv_offload_bytes=0)
    idle = [engine.session() for _ in range(2)]
    for i, s in enumerate(idle):
        s.append(ids(40, 10 + i))
        s.end_turn(["build"], expected_s=1000.0)  # pinned far longer than this test
    running = engine.session()  # the youngest conversation: every other request outranks it
    running.queue(ids(30, 20))
    low = running.start_generate(max_tokens=20, ignore_eos=True, speculative=False)
    for _ in range(3):
        engine.scheduler.step()
    assert running.table.pages and low.output
    older = engine.session()
    older.queue(ids(50, 30))
    # An older conversation's turn: it outranks `low`, yet the idle pinned KV goes first.
    older_req = older.start_generate(max_tokens=8, ignore_eos=True, speculative=False)
    engine.scheduler.wait(older_req)
    engine.scheduler.wait(low)
    assert older_req.error is None and low.error is None
    assert low.preemptions == 0 and engine.scheduler.counters.preemptions == 0
    assert any(not s.table.pages for s in idle)  # an idle pinned session gave way instead
    for s in idle + [running, older]:
        s.close()


def test_a_preempted_request_is_not_preempted_again_before_it_progresses(ckpt, roomy):
    # Three conversations, oldest first, in a pool that holds about two: the
    # youngest gives way, but once only until it has drawn a new token.
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=26, prefix_cache=False, program_admission=False,
                                    kv_offload_bytes=0, limits=Limits(max_num_batched_tokens=16, prefill_chunk=8))
    prompts = [ids(24, 40 + i) for i in range(3)]
    sessions = [engine.session() for _ in prompts]
    reqs = []
    for s, p in zip(reversed(sessions), reversed(prompts)):  # the youngest starts first
        s.queue(p)
        reqs.append(s.start_generate(max_tokens=24, ignore_eos=True, speculative=False))
    for r in reqs:
        engine.scheduler.wait(r)
    assert all(r.error is None for r in reqs)
    assert [r.output for r in reversed(reqs)] == [alone(roomy, [p], 24)[0] for p in prompts]
    c = engine.scheduler.counters
    assert c.preemptions > 0  # the pool really was too small for all three
    assert c.repeat_preemptions == 0 or all(r.preemptions <= 1 + len(r.output) for r in reqs)
    for s in sessions:
        s.close()


def test_programs_sharing_a_prefix_are_admitted_together(ckpt, roomy):
    # Three agents of one role: a 64-token shared prefix (their system prompt
    # and tools) and 8 tokens of their own, 8 drawn. Counted apart, each is 72
    # tokens held, as many expected next turn and its reply (38 pages): two
    # would not fit the 52-page pool. The prefix held once and reused from
    # the cache, the newcomers add 6 pages each: all three do.
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=52, kv_offload_bytes=0,
                                    limits=Limits(max_num_batched_tokens=32, prefill_chunk=8))
    prefix = ids(64, 90)
    prompts = [prefix + ids(8, 91 + i) for i in range(3)]
    sessions = [engine.session() for _ in prompts]
    sessions[0].queue(prompts[0])
    reqs = [sessions[0].start_generate(max_tokens=8, ignore_eos=True, speculative=False)]
    while not reqs[0].output:  # its prompt computed (the prefix now cached), it is still running
        engine.scheduler.step()
    for s, p in zip(sessions[1:], prompts[1:]):
        s.queue(p)
        reqs.append(s.start_generate(max_tokens=8, ignore_eos=True, speculative=False))
    engine.scheduler.step()
    assert engine.scheduler.programs.refusals == 0
    assert engine.scheduler.programs.counts([], [])["admitted"] == 3
    for r in reqs:
        engine.scheduler.wait(r)
    assert [r.output for r in reqs] == [alone(roomy, [p], 8)[0] for p in prompts]
    assert engine.scheduler.counters.preemptions == 0
    for s in sessions:
        s.close()


def test_admission_queues_a_program_rather_than_thrash(ckpt, roomy):
    # Each program: a 40-token prompt and 3 turns of 12 more + 12 drawn, about
    # 120 tokens: the 32-page pool (128 tokens) holds one, not two at once.
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=32, prefix_cache=False, kv_offload_bytes=0,
                                    retention=RetentionConfig(tool_ttl_floor=0.0),
                                    limits=Limits(max_num_batched_tokens=16, prefill_chunk=8))
    programs = [[ids(40, 60 + i)] + [ids(12, 70 + 10 * i + t) for t in range(2)] for i in range(3)]
    sessions = [engine.session() for _ in programs]
    replies: list[list[list[int]]] = [[] for _ in programs]
    turn = [0] * len(programs)
    pending = {}
    for i, s in enumerate(sessions):
        s.queue(programs[i][0])
        pending[i] = s.start_generate(max_tokens=12, ignore_eos=True, speculative=False)
    while pending:
        engine.scheduler.step()
        for i, r in list(pending.items()):
            if not r.done.is_set():
                continue
            assert r.error is None
            replies[i].append(r.output)
            turn[i] += 1
            del pending[i]
            if turn[i] < len(programs[i]):
                # The next turn at once, as an agent whose tool returned: the program is still running.
                sessions[i].queue(programs[i][turn[i]])
                pending[i] = sessions[i].start_generate(max_tokens=12, ignore_eos=True, speculative=False)
    assert replies == [alone(roomy, p, 12) for p in programs]
    c = engine.scheduler.counters
    assert engine.scheduler.programs.refusals > 0  # programs waited whole
    assert c.preemptions == 0  # nothing thrashed
    for s in sessions:
        s.close()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(8, 30), st.integers(1, 3), st.integers(4, 10)), min_size=3, max_size=6),
       st.integers(0, 10**6), st.booleans())
def test_many_programs_in_a_third_of_their_working_set(ckpt, roomy, shapes, seed, admission):
    """Every program finishes with the replies it gets alone, and no request
    is preempted twice without progress between, admission on or off."""
    programs = [[ids(n, seed + 31 * i)] + [ids(6, seed + 31 * i + t + 1) for t in range(turns - 1)]
                for i, (n, turns, _) in enumerate(shapes)]
    gens = [g for _, _, g in shapes]
    working_set = sum(len(sum(p, [])) + g * len(p) for p, g in zip(programs, gens))
    biggest = max(len(sum(p, [])) + g * len(p) for p, g in zip(programs, gens))
    pages = max(working_set // 3, biggest + 2 * PS) // PS + 2
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=pages, prefix_cache=False, kv_offload_bytes=0,
                                    program_admission=admission, pin_ttl=0.0,
                                    limits=Limits(max_num_batched_tokens=16, prefill_chunk=8))
    sessions = [engine.session() for _ in programs]
    replies: list[list[list[int]]] = [[] for _ in programs]
    pending = {}
    for i, s in enumerate(sessions):
        s.queue(programs[i][0])
        pending[i] = s.start_generate(max_tokens=gens[i], ignore_eos=True, speculative=False)
    all_reqs = list(pending.values())
    while pending:
        engine.scheduler.step()
        engine.pool.check()
        for i, r in list(pending.items()):
            if r.done.is_set():
                assert r.error is None, r.error
                replies[i].append(r.output)
                del pending[i]
                t = len(replies[i])
                if t < len(programs[i]):
                    sessions[i].queue(programs[i][t])
                    pending[i] = sessions[i].start_generate(max_tokens=gens[i], ignore_eos=True, speculative=False)
                    all_reqs.append(pending[i])
    assert replies == [alone(roomy, p, g) for p, g in zip(programs, gens)]
    c = engine.scheduler.counters
    event(f"admission={admission} preempted={c.preemptions > 0} refused={engine.scheduler.programs.refusals > 0}")
    assert c.repeat_preemptions == sum(max(0, r.preemptions - 1) for r in all_reqs)
    if admission:  # programs that do not fit wait whole: nothing is preempted twice
        assert c.repeat_preemptions == 0
    else:  # thrash is possible, but each repeat needs progress in between
        assert all(r.preemptions <= 1 + len(r.output) for r in all_reqs)
    for s in sessions:
        s.close()


def test_a_program_keeps_its_place_while_its_tool_runs(ckpt):
    # A turn works on a fork that the session adopts when it ends: the
    # program is the family, so its place outlives the fork.
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64, prefix_cache=False, kv_offload_bytes=0)
    programs = engine.scheduler.programs
    s = engine.session()
    work = s.fork_for_turn()
    work.queue(ids(20, 90))
    work.generate(max_tokens=4, ignore_eos=True, speculative=False)
    s.adopt(work)
    s.end_turn(["build"], expected_s=1000.0)
    programs.start_pass()
    assert list(programs.admitted) == [s.key]  # pinned for its tool: it keeps its place
    s.end_turn([])  # a final answer, no pause after one seen yet: pinned for final_ttl (0), its place goes
    programs.start_pass()
    assert not programs.admitted
    work = s.fork_for_turn()  # the next user turn follows at once, as agents' do: that pause is learned
    work.queue(ids(6, 91))
    work.generate(max_tokens=4, ignore_eos=True, speculative=False)
    s.adopt(work)
    s.end_turn([])
    assert s.pin_ttl > 0
    programs.start_pass()
    assert list(programs.admitted) == [s.key]  # it keeps its place across the answer
    s.close()


def test_a_newcomer_runs_as_a_guest_on_what_the_admitted_programs_leave(ckpt, roomy):
    # 32 pages: the admitted program holds 21 in its tool pause; a newcomer's
    # 60-token program does not fit beside it. With nothing else to run it
    # runs as a guest once its turn (60 s at 1 s a token) would be done
    # before the paused program is back: holding no place, it takes no
    # pinned KV due back sooner than its recompute (84 s), never preempts
    # the admitted program, and its own KV gives way first when that program
    # is back.
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=32, prefix_cache=False, kv_offload_bytes=0,
                                    retention=RetentionConfig(tool_ttl_floor=0.0))
    sched, programs = engine.scheduler, engine.scheduler.programs
    programs.expect_returns = True  # as while the serving loop runs: others can come back meanwhile
    paused, newcomer = engine.session(), engine.session()
    paused.queue(ids(80, 92))
    first = paused.generate(max_tokens=4, ignore_eos=True, speculative=False)
    sched.policy.prefill_s_per_token = 1.0
    paused.end_turn(["build"], expected_s=2.0)  # back in 2 s
    newcomer.queue(ids(60, 93))
    req = newcomer.start_generate(max_tokens=4, ignore_eos=True, speculative=False)
    for _ in range(3):
        sched.step()
        engine.pool.check()
    assert programs.waits(req) and not req.done.is_set()  # waits: the paused program is back first
    assert len(paused.table.pages) == 21 and list(programs.admitted) == [paused.key]
    paused.end_turn(["build"], expected_s=1000.0)  # a long tool: the pool would idle through it
    sched.wait(req)
    assert req.error is None and req.output == alone(roomy, [ids(60, 93)], 4)[0]
    assert list(programs.admitted) == [paused.key]  # a guest holds no place
    assert not paused.table.pages  # its pinned KV gave way to the guest
    newcomer.end_turn(["build"], expected_s=1000.0)
    paused.queue(ids(8, 94))  # back: the guest's KV, pinned as long, gives way first
    nxt = paused.generate(max_tokens=4, ignore_eos=True, speculative=False)
    assert [first, nxt] == alone(roomy, [ids(80, 92), ids(8, 94)], 4)
    assert not newcomer.table.pages and paused.table.pages
    paused.close()
    newcomer.queue(ids(8, 95))  # it fits now: its next turn takes a place
    req = newcomer.start_generate(max_tokens=4, ignore_eos=True, speculative=False)
    sched.wait(req)
    assert req.error is None and list(programs.admitted) == [newcomer.key]
    newcomer.close()


def test_a_small_program_is_admitted_around_a_large_one_until_that_one_has_waited_long(ckpt, roomy):
    # 32 pages. The admitted program (20 tokens, paused for a long tool)
    # counts 11 pages; the first waiting one (60 tokens) needs 31 and does
    # not fit beside it; a later 8-token one (5 pages) does and is admitted
    # around it. Once the large one has waited BACKFILL_WAIT_S, later ones
    # wait behind it, so it cannot starve.
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=32, prefix_cache=False, kv_offload_bytes=0)
    sched, programs = engine.scheduler, engine.scheduler.programs
    programs.expect_returns = True  # as while the serving loop runs
    paused, large, small, later = (engine.session() for _ in range(4))
    paused.queue(ids(20, 140))
    paused.generate(max_tokens=4, ignore_eos=True, speculative=False)
    sched.policy.prefill_s_per_token = 100.0  # the large one's turn outlasts the pause: it never runs as a guest
    paused.end_turn(["build"], expected_s=1000.0)
    large.queue(ids(60, 141))
    big = large.start_generate(max_tokens=4, ignore_eos=True, speculative=False)
    small.queue(ids(8, 142))
    quick = small.start_generate(max_tokens=4, ignore_eos=True, speculative=False)
    sched.step()
    assert programs.waits(big) and programs.placed(small.key)  # admitted around the large one
    sched.wait(quick)
    big.queued_at -= BACKFILL_WAIT_S  # as if it had waited that long
    later.queue(ids(8, 143))
    last = later.start_generate(max_tokens=4, ignore_eos=True, speculative=False)
    sched.step()
    assert programs.waits(last) and programs.waits(big)  # it would fit, but waits behind the large one
    paused.close()
    small.close()
    for r in (big, last):
        sched.wait(r)
    assert [big.output, quick.output, last.output] == [alone(roomy, [p], 4)[0]
                                                      for p in (ids(60, 141), ids(8, 142), ids(8, 143))]
    for s in (large, later):
        s.close()


def test_a_young_programs_growth_is_what_other_programs_later_turns_added(ckpt):
    # A program's first turn carries its whole prompt: as a guess of what its
    # next turn adds it kept growing programs out and let young ones thrash.
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=256, prefix_cache=False, kv_offload_bytes=0)
    programs = engine.scheduler.programs
    old, young = engine.session(), engine.session()
    old.queue(ids(40, 95))
    old.generate(max_tokens=4, ignore_eos=True, speculative=False)
    assert programs.admitted[old.key].growth == 40  # nothing seen yet: its own delta
    old.queue(ids(12, 96))
    old.generate(max_tokens=4, ignore_eos=True, speculative=False)
    assert programs.admitted[old.key].growth == 16  # its reply and the next delta
    young.queue(ids(40, 97))
    young.generate(max_tokens=4, ignore_eos=True, speculative=False)
    assert programs.admitted[young.key].growth == 16  # what later turns add, not its first prompt
    for s in (old, young):
        s.close()


def test_a_program_waiting_for_its_place_keeps_its_cached_prefix_past_idle_sessions(ckpt, roomy):
    # An agent's history is only in the prefix cache (its session went) when
    # its next turn is queued, its program holding no place yet. Room is then
    # made from an unused cached prefix and an idle session past its pin
    # first: the waiting turn's prefix goes only after them (due back, it
    # would otherwise recompute its whole history once admitted), still
    # before any session inside its pin.
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=40, kv_offload_bytes=0)
    sched, radix = engine.scheduler, engine.scheduler.policy.radix
    history, unused = ids(40, 1), ids(20, 2)
    for tokens in (history, unused):
        with engine.session() as s:
            s.append(tokens)  # closed: only the prefix cache holds it (15 pages in all)
    idle, pinned = engine.session(), engine.session()
    idle.append(ids(24, 3))  # 6 pages, past its pin at once
    idle.release()
    pinned.append(ids(16, 4))  # 4 pages, pinned for its tool
    pinned.end_turn(["build"], expected_s=1000.0)
    sched.programs.start_pass()  # the idle programs' places go
    waiting = engine.session()
    delta = ids(4, 5)
    waiting.queue(history + delta)
    req = waiting.start_generate(max_tokens=6, ignore_eos=True, speculative=False)
    assert sched.programs.waits(req) and radix.peek(history)[0] == 40
    free = engine.pool.num_free
    assert sched.make_room(free + 11)  # the unused prefix (5 pages) and the idle session (6)
    assert not idle.table.pages and pinned.table.pages
    assert radix.peek(unused)[0] == 0 and radix.peek(history)[0] == 40
    assert sched.make_room(free + 21, soft_pins=True)  # then the waiting turn's prefix, before the pin
    assert pinned.table.pages and radix.peek(history)[0] == 0
    sched.wait(req)
    assert req.error is None and req.output == alone(roomy, [history + delta], 6)[0]
    for s in (waiting, idle, pinned):
        s.close()


def test_a_turn_waiting_for_its_programs_place_gives_its_kv_to_running_work(ckpt, roomy):
    # An older agent's session holds its history (11 pages) and its program's
    # place is gone (its last turn ended on an answer). A younger program runs
    # a long generation; the older agent's next turn then arrives, carrying
    # the history on its fork, and waits: it does not fit beside the running
    # one. When the running one needs those pages, the waiting turn's KV gives
    # way, however old its conversation, instead of both waiting for good.
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=30, kv_offload_bytes=0,
                                    limits=Limits(max_num_batched_tokens=16, prefill_chunk=8))
    sched = engine.scheduler
    older, younger = engine.session(), engine.session()
    older.queue(ids(40, 101))
    first = older.generate(max_tokens=4, ignore_eos=True, speculative=False)
    older.end_turn([])  # a final answer: its program's place goes at the next step
    younger.queue(ids(40, 102))
    long = younger.start_generate(max_tokens=56, ignore_eos=True, speculative=False)
    for _ in range(8):
        sched.step()
    assert long.admitted and older.table.pages
    work = older.fork_for_turn()
    work.queue(ids(8, 103))
    nxt = work.start_generate(max_tokens=4, ignore_eos=True, speculative=False)
    for _ in range(400):
        if long.done.is_set() and nxt.done.is_set():
            break
        sched.step()
        engine.pool.check()
    assert long.done.is_set() and nxt.done.is_set(), "the running program and the waiting turn stalled each other"
    assert long.error is None and nxt.error is None
    older.adopt(work)
    # Both got the replies they get alone: giving way cost the waiting turn a recompute, nothing else.
    assert long.output == alone(roomy, [ids(40, 102)], 56)[0]
    assert [first, nxt.output] == alone(roomy, [ids(40, 101), ids(8, 103)], 4)
    assert sched.programs.refusals > 0
    for s in (older, younger):
        s.close()


def test_younger_work_waits_for_an_older_programs_kv_due_back_sooner_than_its_recompute(ckpt, roomy):
    # 32 pages. The older program's 84 tokens (21 pages) are paused for a tool
    # due back in 7 s; bringing them back would cost 8.4 s (84 tokens at
    # 0.1 s): the younger program's prefill waits for them rather than take
    # their pages. Once the older one is paused for a long tool, the younger
    # one takes them.
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=32, prefix_cache=False, kv_offload_bytes=0,
                                    retention=RetentionConfig(tool_ttl_floor=0.0),
                                    limits=Limits(max_num_batched_tokens=16, prefill_chunk=8))
    sched, programs = engine.scheduler, engine.scheduler.programs
    programs.expect_returns = True  # as while the serving loop runs
    older, younger = engine.session(), engine.session()
    older.queue(ids(80, 110))
    first = older.generate(max_tokens=4, ignore_eos=True, speculative=False)
    sched.policy.prefill_s_per_token = 0.1
    older.end_turn(["build"], expected_s=7.0)
    younger.queue(ids(60, 111))  # its turn (6 s) ends before the older one is back: admitted
    req = younger.start_generate(max_tokens=4, ignore_eos=True, speculative=False)
    for _ in range(20):
        sched.step()
        engine.pool.check()
    assert not programs.waits(req) and not req.done.is_set()
    assert len(older.table.pages) == 21  # held: the younger one's prefill waits
    older.queue(ids(8, 112))  # back: it runs first
    nxt = older.start_generate(max_tokens=4, ignore_eos=True, speculative=False)
    sched.wait(nxt)
    older.end_turn(["build"], expected_s=1000.0)  # a long tool: waiting for it would cost more than its recompute
    sched.wait(req)
    assert req.error is None and nxt.error is None
    assert [first, nxt.output] == alone(roomy, [ids(80, 110), ids(8, 112)], 4)
    assert req.output == alone(roomy, [ids(60, 111)], 4)[0]
    for s in (older, younger):
        s.close()


def test_the_loop_counts_the_seconds_it_idles_while_a_program_waits_for_its_place(ckpt):
    # What admission costs shows in the counters: the admitted program is
    # paused, due back before the newcomer's turn would be done, so the loop
    # idles with the newcomer waiting for a place, and says why.
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=32, prefix_cache=False, kv_offload_bytes=0,
                                    retention=RetentionConfig(tool_ttl_floor=0.0))
    sched = engine.scheduler
    paused, newcomer = engine.session(), engine.session()
    paused.queue(ids(80, 130))
    paused.generate(max_tokens=4, ignore_eos=True, speculative=False)
    sched.policy.prefill_s_per_token = 1.0
    paused.end_turn(["build"], expected_s=30.0)
    newcomer.queue(ids(60, 131))
    req = newcomer.start_generate(max_tokens=4, ignore_eos=True, speculative=False)
    sched.start()
    try:
        time.sleep(0.5)
        stalled = dict(engine.metrics().counters.stalled_s)
        assert not req.done.is_set()
    finally:
        sched.stop()  # fails the waiting request, rolled back
    assert 0.3 < stalled["admission"] < 1.0
    assert all(v == 0.0 for k, v in stalled.items() if k != "admission")
    for s in (paused, newcomer):
        s.close()
