"""AgentDojo's benign user tasks as replayed trajectories: the same traces
byte for byte on every build and in any process, every tool message the
real result of the call it answers on the state the calls before it left,
no injection anywhere, conversations that grow with their user turns."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("agentdojo", reason="AgentDojo's suites come from PyPI's agentdojo (installed --no-deps)")

from agentdojo.agent_pipeline.tool_execution import tool_result_to_str  # noqa: E402
from agentdojo.functions_runtime import FunctionsRuntime  # noqa: E402
from agentdojo.task_suite.load_suites import get_suite  # noqa: E402

from agentkv.experiments.workloads.agentdojo_traces import (BENCHMARK_VERSION, FIXED_NOW, SUITES,  # noqa: E402
                                                            agentdojo_traces, reproducible_tools)


def dumped(traces) -> str:
    return json.dumps([(t.agent, t.family, t.group, t.tools, t.messages) for t in traces])


def calls_of(trace) -> list[dict]:
    return [c for m in trace.messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]


@pytest.fixture(scope="module")
def workspace():
    return agentdojo_traces(4, seed=0, user_turns=3)


def test_the_same_traces_on_every_build_and_in_any_process(workspace):
    assert dumped(agentdojo_traces(4, seed=0, user_turns=3)) == dumped(workspace)
    assert [t.messages for t in agentdojo_traces(4, seed=1, user_turns=3)] != [t.messages for t in workspace]
    # What makes it hard: sent emails and written files are stamped with the
    # clock, calendar participants pass through a set (string-hash order).
    names = [c["function"]["name"] for t in workspace for c in calls_of(t)]
    assert {"send_email", "create_file", "create_calendar_event"} <= set(names)
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    code = ("import json, sys; from agentkv.experiments.workloads.agentdojo_traces import agentdojo_traces; "
            "sys.stdout.write(json.dumps([(t.agent, t.family, t.group, t.tools, t.messages) "
            "for t in agentdojo_traces(4, seed=0, user_turns=3)]))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=os.environ | {"PYTHONHASHSEED": seed})
    assert other.stdout == dumped(workspace)


def test_what_the_tools_write_does_not_depend_on_the_clock_or_the_string_hash():
    suite = get_suite(BENCHMARK_VERSION, "workspace")
    env = suite.load_and_inject_default_environment({})
    runtime = FunctionsRuntime(suite.tools)
    people = [f"guest{i}@example.com" for i in range(8)]  # a set's order matches theirs by chance 1 in 9!
    with reproducible_tools():
        event, _ = runtime.run_function(env, "create_calendar_event", {
            "title": "Review", "start_time": "2024-05-20 10:00", "end_time": "2024-05-20 11:00",
            "participants": people}, raise_on_error=True)
        file, _ = runtime.run_function(env, "create_file", {"filename": "notes.txt", "content": "x"},
                                       raise_on_error=True)
    assert event.participants == people + [env.calendar.account_email]
    invitation = env.inbox.emails[max(env.inbox.emails, key=int)]
    assert invitation.subject == "Invitation: Review" and invitation.timestamp == FIXED_NOW
    assert file.last_modified == FIXED_NOW


def test_every_tool_message_answers_the_call_just_before_it(workspace):
    for t in workspace:
        for i, m in enumerate(t.messages):
            if m["role"] == "tool":
                before = t.messages[i - 1]
                assert before["role"] == "assistant" and [c["id"] for c in before["tool_calls"]] == [m["tool_call_id"]]
        index = t.agent.rsplit("-", 1)[1]
        assert [c["id"] for c in calls_of(t)] == [f"call_{index}_{n}" for n in range(len(calls_of(t)))]


def test_tool_outputs_are_the_real_results_in_order_on_a_fresh_environment(workspace):
    suite = get_suite(BENCHMARK_VERSION, "workspace")
    for t in workspace:
        env = suite.load_and_inject_default_environment({})
        runtime = FunctionsRuntime(suite.tools)
        outputs = [m["content"] for m in t.messages if m["role"] == "tool"]
        with reproducible_tools():
            replayed = [tool_result_to_str(runtime.run_function(env, c["function"]["name"],
                                                                json.loads(c["function"]["arguments"]),
                                                                raise_on_error=True)[0])
                        for c in calls_of(t)]
        assert replayed == outputs
    # The first call outside the fixed clock too: read on the default state, its output is the same.
    first = calls_of(workspace[0])[0]
    result, error = FunctionsRuntime(suite.tools).run_function(
        suite.load_and_inject_default_environment({}), first["function"]["name"],
        json.loads(first["function"]["arguments"]))
    assert error is None and tool_result_to_str(result) == next(m for m in workspace[0].messages
                                                                if m["role"] == "tool")["content"]


def test_each_turn_is_a_task_prompt_its_calls_and_a_reply(workspace):
    suite = get_suite(BENCHMARK_VERSION, "workspace")
    prompts = {task.PROMPT: task for task in suite.user_tasks.values()}
    for t in workspace:
        assert t.messages[0]["role"] == "system" and "Emma Johnson" in t.messages[0]["content"]
        users = [i for i, m in enumerate(t.messages) if m["role"] == "user"]
        assert len(users) == 3 and len({t.messages[i]["content"] for i in users}) == 3
        for start, end in zip(users, users[1:] + [len(t.messages)]):
            task = prompts[t.messages[start]["content"]]
            turn = t.messages[start + 1:end]
            assert turn[-1] == {"role": "assistant", "content": task.GROUND_TRUTH_OUTPUT or "Done."}
            assert all(m["role"] in ("assistant", "tool") for m in turn[:-1])


def test_no_injection_text_in_any_suite():
    traces = agentdojo_traces(8, seed=0, suites=SUITES, user_turns=2)
    assert [t.group for t in traces] == list(SUITES) * 2
    assert traces[0].tools == traces[4].tools and traces[0].tools != traces[1].tools
    text = dumped(traces)
    assert "<INFORMATION>" not in text and "important message from me" not in text
    for name in SUITES:
        for task in get_suite(BENCHMARK_VERSION, name).injection_tasks.values():
            assert task.GOAL not in text


def test_conversations_grow_with_their_user_turns():
    by_turns = [agentdojo_traces(2, seed=3, user_turns=k) for k in (1, 2, 3)]
    for fewer, more in zip(by_turns, by_turns[1:]):
        for a, b in zip(fewer, more):
            assert b.messages[: len(a.messages)] == a.messages and len(b.messages) > len(a.messages)
            assert len(json.dumps(b.messages)) > len(json.dumps(a.messages))


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="suites"):
        agentdojo_traces(2, 0, suites=("email",))
    with pytest.raises(ValueError, match="user_turns"):
        agentdojo_traces(2, 0, user_turns=0)
    with pytest.raises(ValueError, match="apply in turn"):
        agentdojo_traces(1, 0, suites=("banking",), user_turns=17)
