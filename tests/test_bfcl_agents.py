"""experiments.workloads.bfcl_agents without a model: BFCL's multi-turn
conversations as agents (drawn per role, cut to their turns), their working
set, and the live loop with its tool pauses, end-state check and failures,
driven by clients that answer as the ground truth does or fail."""
from __future__ import annotations

import pytest

pytest.importorskip("bfcl_eval")

from agentkv.experiments.workloads.agent_runs import Pauses, Reply, run_all, summarize  # noqa: E402
from agentkv.experiments.workloads.bfcl_agents import (parsed_call, kv_budget, pick_agents,  # noqa: E402
                                                       reference_messages, run_bfcl_agent)
from agentkv.model.default import small_model_dir  # noqa: E402
from agentkv.model.loader import load_tokenizer  # noqa: E402


def ground_truth_client(agents):
    """Answers each user turn with the ground truth's calls, then "Done."."""
    by_name = {a.agent: a for a in agents}

    def client(agent, messages, tools, max_tokens):
        a = by_name[agent]
        turn = sum(m["role"] == "user" for m in messages) - 1
        calls = a.ground_truth[turn] if messages[-1]["role"] == "user" else []
        parsed = [dict(zip(("name", "arguments"), parsed_call(c)), id=f"c{turn}_{i}") for i, c in enumerate(calls)]
        return Reply(None if parsed else "Done.", parsed, 100 * len(messages), 10, "tool_calls" if parsed else "stop",
                     completion_tokens=5)

    return client


def test_agents_are_spread_over_roles_seeded_and_cut_to_their_turns():
    agents = pick_agents(5, 2, seed=3, roles=("GorillaFileSystem", "TradingBot"))
    assert [a.role for a in agents] == ["GorillaFileSystem", "TradingBot"] * 2 + ["GorillaFileSystem"]
    assert len({a.entry["id"] for a in agents}) == 5
    assert all(len(a.entry["question"]) == len(a.ground_truth) == 2 for a in agents)
    assert [a.agent for a in pick_agents(5, 2, seed=3, roles=("GorillaFileSystem", "TradingBot"))] == \
        [a.agent for a in agents]
    assert [a.agent for a in pick_agents(5, 2, seed=4, roles=("GorillaFileSystem", "TradingBot"))] != \
        [a.agent for a in agents]
    with pytest.raises(ValueError, match="MathAPI"):
        pick_agents(3, 2, 0, roles=("MathAPI",))  # only multi-class conversations use it


def test_a_role_out_of_conversations_is_passed_over():
    # BFCL has 13 GorillaFileSystem conversations of 2 turns or more and 20 TradingBot ones.
    agents = pick_agents(32, 2, 0)
    roles = [a.role for a in agents]
    assert roles[:26] == ["GorillaFileSystem", "TradingBot"] * 13 and roles[26:] == ["TradingBot"] * 6
    assert len({a.entry["id"] for a in agents}) == 32
    with pytest.raises(ValueError, match="34 wanted"):
        pick_agents(34, 2, 0)


def test_the_working_set_holds_each_role_s_docs_once():
    agents = pick_agents(4, 2, 0)
    tok = load_tokenizer(small_model_dir())
    budget = kv_budget(tok, agents, 64, 0.5, 16)
    assert budget["tokens"] % 16 == 0 and budget["tokens"] <= budget["working_set_tokens"] * 0.5
    # Two agents per role: each role's function docs (thousands of tokens) are counted once in distinct.
    assert budget["shared_prefix_tokens"] > 2 * 1000
    assert budget["distinct_tokens"] == budget["working_set_tokens"] - budget["shared_prefix_tokens"]
    ref = reference_messages(agents[0])
    assert [m["role"] for m in ref[:1]] == ["user"] and ref[-1] == {"role": "assistant", "content": "Done."}
    with pytest.raises(ValueError, match="longest agent"):
        kv_budget(tok, agents, 64, 0.05, 16)


def test_agents_that_call_as_the_ground_truth_pass_and_pause_per_tool_class():
    agents = pick_agents(4, 2, 0)
    client = ground_truth_client(agents)
    pauses = Pauses(seed=1, scale=0.001)
    jobs = {a.agent: (lambda a=a, **kw: run_bfcl_agent(a, client, 64, 4, pauses, **kw)) for a in agents}
    records, wall = run_all(jobs)
    for a, r in zip(agents, records):
        assert r.passed, (a.agent, r.reason)
        calling = [t for t in r.turns if t.tools]
        assert len(calling) == sum(1 for calls in a.ground_truth if calls)
        assert all(t.pause_s > 0 for t in calling) and all(t.pause_s == 0 for t in r.turns if not t.tools)
        assert [t.turn for t in r.turns] == sorted(t.turn for t in r.turns)
        assert all(t.start_s >= 0 for t in r.turns)
    s = summarize(records, wall)
    assert s["jobs_passed"] == s["jobs_checked"] == 4 and s["errors"] == []
    assert s["completed_turns"] == s["planned_turns"] == 8 and s["requests"] > 8
    # The pause is the tool class's draw: the same for a rerun, whatever the threads did.
    again, _ = run_all(jobs)
    assert [t.pause_s for r in again for t in r.turns] == [t.pause_s for r in records for t in r.turns]


def test_an_agent_that_does_nothing_fails_the_check_and_a_failed_request_ends_its_job():
    [agent] = pick_agents(1, 2, 0)
    idle = run_bfcl_agent(agent, lambda *a: Reply("I cannot.", [], 10, 0, "stop"), 64, 4, Pauses(0, 0))
    assert idle.passed is False and idle.reason and not idle.errors

    def broken(agent_name, messages, tools, max_tokens):
        raise ConnectionError("server went away")

    failed = run_bfcl_agent(agent, broken, 64, 4, Pauses(0, 0))
    assert failed.passed is False and failed.errors == ["ConnectionError: server went away"]
    assert len(failed.turns) == 1
