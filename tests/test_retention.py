"""The retention policy: pins learned per tool, the order in which idle
sessions give way, and a hypothesis-driven workload over a small pool with
the second tier that never leaks a page, never serves one session another's
KV and never evicts a pinned session while lower-priority pages exist."""
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import Engine, InvalidRequestError
from agentkv.engine.retention import MAX_TOOLS_PER_OWNER, Retention, RetentionConfig
from tests.test_kv_tier import PS, ckpt, ids, reference  # noqa: F401 (fixtures)


class _Seq:
    """What the policy reads of a sequence."""

    def __init__(self, namespace: str = "default"):
        self.awaiting, self.answered, self.pin_ttl, self.idle_since = None, False, None, time.monotonic()
        self.namespace = namespace


def test_pin_follows_the_observed_pause_of_each_tool():
    r = Retention(RetentionConfig(tool_ttl_default=10.0, tool_ttl_floor=1.0, tool_ttl_cap=60.0, margin=1.5,
                                  smoothing=0.5))
    seq = _Seq()
    r.end_turn(seq, ["search"])
    assert seq.awaiting == ("search",) and seq.pin_ttl == 15.0  # never seen: the default
    seq.idle_since = time.monotonic() - 4.0
    r.resumed(seq, time.monotonic())
    assert seq.awaiting is None
    assert r.estimates()["search"]["pause_s"] == pytest.approx(4.0, abs=0.05)
    r.end_turn(seq, ["search"])
    assert seq.pin_ttl == pytest.approx(6.0, abs=0.1)
    seq.idle_since = time.monotonic() - 8.0
    r.resumed(seq, time.monotonic())  # moving estimate: half old, half new
    assert r.estimates()["search"]["pause_s"] == pytest.approx(6.0, abs=0.1)
    r.end_turn(seq, ["search", "compile"])  # run together: the slower one's pin
    assert seq.pin_ttl == 15.0
    seq.idle_since = time.monotonic() - 1000.0
    r.resumed(seq, time.monotonic())  # capped: a session left alone is not a tool's duration
    assert r.estimates()["compile"]["pause_s"] == 60.0
    r.end_turn(seq, ["compile"])
    assert seq.pin_ttl == 60.0
    r.end_turn(seq, ["x"], expected_s=0.1)  # the client's word, within the floor
    assert seq.pin_ttl == 1.0
    r.end_turn(seq, [])  # a final answer
    assert seq.awaiting is None and seq.pin_ttl == 0.0


def test_each_tenant_learns_its_own_tools_pauses():
    # Issue 42: estimates were global, so one tenant's slow (or fake) "search"
    # set every tenant's pins for its own "search".
    r = Retention(RetentionConfig(tool_ttl_default=10.0, tool_ttl_floor=1.0, tool_ttl_cap=60.0, margin=1.0,
                                  smoothing=1.0))
    hostile, other, salted = _Seq("mallory"), _Seq("alice"), _Seq("mallory:salt")
    r.end_turn(hostile, ["search"])
    hostile.idle_since = time.monotonic() - 50.0
    r.resumed(hostile, time.monotonic())
    r.end_turn(other, ["search"])
    assert other.pin_ttl == 10.0  # the default: mallory's pauses are not alice's
    r.end_turn(salted, ["search"])
    assert salted.pin_ttl == pytest.approx(50.0, abs=0.1)  # a cache salt is the same tenant
    assert r.estimates("alice") == {} and set(r.estimates("mallory")) == {"search"}


def test_a_tenants_tool_names_are_bounded():
    # Tool names are the client's: a tenant inventing new ones kept growing the
    # table. Past MAX_TOOLS_PER_OWNER its least recently observed are forgotten.
    r = Retention(RetentionConfig(tool_ttl_default=10.0, tool_ttl_floor=1.0, tool_ttl_cap=60.0, margin=1.0,
                                  smoothing=1.0))
    other = _Seq("alice")
    r.end_turn(other, ["search"])
    other.idle_since = time.monotonic() - 3.0
    r.resumed(other, time.monotonic())
    hostile = _Seq("mallory")
    for i in range(MAX_TOOLS_PER_OWNER + 10):
        r.end_turn(hostile, [f"tool{i}"])
        hostile.idle_since = time.monotonic() - 20.0
        r.resumed(hostile, time.monotonic())
    known = r.estimates("mallory")
    assert len(known) == MAX_TOOLS_PER_OWNER and "tool0" not in known and f"tool{MAX_TOOLS_PER_OWNER + 9}" in known
    assert set(r.estimates("alice")) == {"search"}
    r.end_turn(hostile, ["tool0"])
    assert hostile.pin_ttl == 10.0  # forgotten: the default again


def test_lru_mode_pins_nothing_and_learns_nothing():
    r = Retention(RetentionConfig(mode="lru"))
    seq = _Seq()
    for tools in (["search"], []):
        r.end_turn(seq, tools)
        assert seq.pin_ttl == 0.0
        seq.idle_since -= 5
        r.resumed(seq, time.monotonic())
    assert r.estimates() == {} and r.answer_estimate() is None


def test_the_pause_after_a_final_answer_is_learned_per_tenant():
    # Agents' next user turn often follows an answer at once; a reply the
    # server cannot read as calls is an answer too. Either way the pause
    # before the next turn is what the pin should follow, not a fixed 0.
    r = Retention(RetentionConfig(final_ttl=0.0, tool_ttl_floor=1.0, tool_ttl_cap=60.0, margin=2.0, smoothing=0.5))
    agent, other = _Seq("alice"), _Seq("bob")
    r.end_turn(agent, [])
    assert agent.answered and agent.awaiting is None and agent.pin_ttl == 0.0  # never observed: final_ttl
    agent.idle_since = time.monotonic() - 3.0
    r.resumed(agent, time.monotonic())
    assert not agent.answered
    assert r.answer_estimate("alice")["pause_s"] == pytest.approx(3.0, abs=0.05)
    r.end_turn(agent, [])
    assert agent.pin_ttl == pytest.approx(6.0, abs=0.1)  # the pause times the margin
    assert r.expected_back(agent) == pytest.approx(agent.idle_since + 3.0, abs=0.05)
    agent.idle_since = time.monotonic() - 0.2
    r.resumed(agent, time.monotonic())
    r.end_turn(agent, [])
    assert agent.pin_ttl == pytest.approx(3.2, abs=0.1)  # the moving estimate (3 + 0.2) / 2, times the margin
    assert r.estimates("alice") == {}  # an answer is no tool
    r.end_turn(other, [])
    assert other.pin_ttl == 0.0 and r.answer_estimate("bob") is None  # one tenant's users set no other's pins
    agent.idle_since = time.monotonic() - 1000.0
    r.resumed(agent, time.monotonic())  # a user gone for good: the cap, never more
    assert r.answer_estimate("alice")["pause_s"] <= 60.0


def test_a_pause_past_its_estimate_is_expected_to_last_as_long_again():
    # Tool pauses are heavy-tailed: one past its estimate is from the tail.
    r = Retention(RetentionConfig(tool_ttl_floor=0.0, margin=2.0))
    seq = _Seq()
    r.end_turn(seq, ["build"], expected_s=4.0)
    now = seq.idle_since + 1.0
    assert r.due_in(seq, now) == pytest.approx(3.0)  # what is left of its estimate
    assert r.due_in(seq, seq.idle_since + 10.0) == pytest.approx(10.0)  # overdue: as long again
    seq.pin_ttl = None  # pinned for good: no turn is expected
    assert r.due_in(seq, now) == float("inf")


def test_bad_retention_config_is_refused():
    for bad in (dict(mode="fifo"), dict(tool_ttl_floor=5, tool_ttl_cap=1), dict(margin=-1), dict(smoothing=0)):
        with pytest.raises(ValueError):
            RetentionConfig(**bad)


def test_idle_sessions_give_way_in_policy_order(reference):
    """Final answers first, then sessions whose tool pin ran out (longest idle
    first); a session inside its pin only when nothing else is left."""
    engine = Engine(reference.model, None, page_size=PS, num_pages=40, retention=RetentionConfig(tool_ttl_floor=0.0))
    final, tool, pinned = (engine.session() for _ in range(3))
    for i, s in enumerate((tool, final, pinned)):
        s.append(ids(80, 20 + i))  # 10 pages each; 10 free
    tool.end_turn(["search"], expected_s=0.0)
    final.end_turn([])
    pinned.end_turn(["build"], expected_s=100.0)
    assert engine.scheduler.make_room(20)  # 10 more: the final answer goes, though the tool session idled longer
    assert not final.table.pages and tool.table.pages and pinned.table.pages
    assert engine.scheduler.make_room(30)
    assert not tool.table.pages and pinned.table.pages
    assert not engine.scheduler.make_room(40)  # the pinned one holds
    assert pinned.table.pages
    assert engine.scheduler.make_room(40, soft_pins=True)
    assert not pinned.table.pages
    with pytest.raises(InvalidRequestError):
        pinned.end_turn(["x"], expected_s=-1)
    for s in (final, tool, pinned):
        s.close()


def test_retain_and_release(reference):
    engine = Engine(reference.model, None, page_size=PS, num_pages=20)
    s = engine.session()
    s.append(ids(80, 30))
    s.release()
    assert engine.scheduler.make_room(20) and not s.table.pages
    s.append(ids(8, 31))  # restored from the tier, the new tokens computed
    s.retain(None)
    assert not engine.scheduler.make_room(20, soft_pins=True) and s.table.pages  # pinned for good
    s.retain(0.0)
    assert engine.scheduler.make_room(20)
    s.close()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 3), st.integers(1, 40)),
        st.tuples(st.just("end_tool"), st.integers(0, 3), st.sampled_from([0.0, 50.0])),
        st.tuples(st.just("end_final"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("release"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("room"), st.integers(0, 3), st.integers(1, 24)),
    ),
    min_size=1, max_size=25,
)


@settings(max_examples=25, deadline=None)
@given(ops)
def test_retention_workload_keeps_every_invariant(reference, script):
    engine = Engine(reference.model, None, page_size=PS, num_pages=24, retention=RetentionConfig(tool_ttl_floor=0.0),
                    kv_offload_bytes=60 * reference.pool.token_bytes)
    sessions = [engine.session() for _ in range(4)]
    for step, (op, i, arg) in enumerate(script):
        s = sessions[i]
        lower = [x for x in sessions if x.table.pages and not x.pinned]
        pinned = [x for x in sessions if x.table.pages and x.pinned]
        try:
            if op == "append":
                s.append(ids(arg, step))
            elif op == "end_tool":
                s.end_turn(["tool"], expected_s=arg)
            elif op == "end_final":
                s.end_turn([])
            elif op == "release":
                s.release()
            else:
                engine.scheduler.make_room(arg)
        except Exception as e:  # only capacity: the session is as before
            assert type(e).__name__ in ("KVCapacityError", "PoolTooSmallError"), e
        lost_pinned = [x for x in pinned if x is not s and not x.table.pages]
        if lost_pinned:  # a pin gave way: nothing of lower priority may still hold pages
            assert all(not x.table.pages for x in lower if x is not s)
        engine.pool.check()
        engine.tier.check()
    for i, s in enumerate(sessions):  # each session's KV is its own
        if len(s) == 0:
            continue
        probe = ids(3, 1000 + i)
        got = s.append(probe, all_logits=True)
        with reference.session() as r:
            want = r.append(s.tokens[: len(s) - 3] + probe, all_logits=True)[-3:]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    for s in sessions:
        s.close()
    assert engine.tier.host_used == 0


def test_pins_over_a_tenants_share_give_way_first(reference):
    """Pinned sessions give way (soft pins) in the order of what each costs to
    bring back per second until it is due; but a tenant pinning more than its
    share of the pool (the pool over the tenants holding pins) loses its
    excess first, so one tenant's many pins cannot push out another's few."""
    engine = Engine(reference.model, None, page_size=PS, num_pages=40, retention=RetentionConfig(tool_ttl_floor=0.0))
    hog = [engine.session("hog") for _ in range(3)]
    small = engine.session("small:salt")  # a cache salt stays its tenant's
    for i, s in enumerate(hog):
        s.append(ids(64, 40 + i))  # 8 pages each: 24, over the 20-page share of two tenants
    small.append(ids(16, 50))  # 2 pages
    for s in hog:
        s.end_turn(["build"], expected_s=10.0)
    small.end_turn(["build"], expected_s=100.0)  # the cheapest to bring back, and due last
    assert engine.scheduler.make_room(40 - 26 + 5, soft_pins=True)  # 5 more pages: one of hog's goes
    assert small.table.pages and sum(not s.table.pages for s in hog) == 1
    # Within its share, a tenant's pins go in the policy's order again: small's first.
    assert engine.scheduler.make_room(40 - 18 + 1, soft_pins=True)
    assert not small.table.pages and sum(not s.table.pages for s in hog) == 1
    for s in (*hog, small):
        s.close()
