"""BFCL's multi-turn conversations as replayed trajectories: every user
turn, the ground-truth calls, their real results from BFCL's own classes;
the same traces on every build; long_context's outputs long."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("bfcl_eval", reason="BFCL's data and classes come from PyPI's bfcl-eval (installed --no-deps)")

from agentkv.experiments.workloads.bfcl import execute_multi_turn_func_call, load_items  # noqa: E402
from agentkv.experiments.workloads.bfcl_traces import bfcl_traces  # noqa: E402


@pytest.fixture(scope="module")
def base():
    return bfcl_traces("bfcl-base", 4, seed=0)


def test_the_same_traces_on_every_build(base):
    again = bfcl_traces("bfcl-base", 4, seed=0)
    assert json.dumps([(t.agent, t.group, t.tools, t.messages) for t in base]) == json.dumps(
        [(t.agent, t.group, t.tools, t.messages) for t in again])
    other = bfcl_traces("bfcl-base", 4, seed=1)
    assert [t.messages for t in other] != [t.messages for t in base]


def test_every_user_turn_with_its_ground_truth_calls_and_real_results(base):
    entries = {i.entry["id"]: i for i in load_items("multi_turn_base", None, 0)}
    for t in base:
        users = [m for m in t.messages if m["role"] == "user"]
        item = next(i for i in entries.values() if i.entry["question"][0][0]["content"] == users[0]["content"])
        assert [m["content"] for m in users] == [q[0]["content"] for q in item.entry["question"]]
        calls = [json.loads(c["function"]["arguments"]) | {"name": c["function"]["name"]}
                 for m in t.messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]
        assert len(calls) == sum(len(turn) for turn in item.answer)
        # Each tool message answers a call of the reply before it.
        for i, m in enumerate(t.messages):
            if m["role"] == "tool":
                owner = next(p for p in reversed(t.messages[:i]) if p["role"] == "assistant")
                assert m["tool_call_id"] in {c["id"] for c in owner["tool_calls"]}
        # The first turn's results are what BFCL's classes give on a fresh instance.
        first_calls = item.answer[0]
        if first_calls:
            expected, _ = execute_multi_turn_func_call(first_calls, item.entry["initial_config"],
                                                       item.entry["involved_classes"], f"check_{t.agent}",
                                                       item.entry["id"])
            got = [m["content"] for m in t.messages if m["role"] == "tool"][: len(first_calls)]
            assert got == [str(r) for r in expected]


def test_agents_spread_over_roles_share_their_tools(base):
    assert [t.group for t in base] == ["GorillaFileSystem", "TradingBot"] * 2
    assert base[0].tools == base[2].tools and base[0].tools != base[1].tools
    assert len({t.agent for t in base}) == 4


def test_long_context_tool_outputs_are_long():
    long = bfcl_traces("bfcl-long", 2, seed=0)
    short = bfcl_traces("bfcl-base", 2, seed=0)
    size = lambda ts: sum(len(m["content"]) for t in ts for m in t.messages if m["role"] == "tool")  # noqa: E731
    assert size(long) > 5 * size(short)


def test_unknown_family_or_too_many_agents_are_clear_errors():
    with pytest.raises(ValueError, match="family"):
        bfcl_traces("bfcl-nope", 2, 0)
    with pytest.raises(ValueError, match="agents wanted"):
        bfcl_traces("bfcl-base", 10_000, 0)
