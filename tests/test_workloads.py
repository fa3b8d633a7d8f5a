import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.experiments.workloads.workflows import (
    COPY_KINDS,
    TASKS,
    Workflow,
    approx_tokens,
    interleaved_run,
    six_turn_workflow,
    thirty_five_turn_workflow,
    turn_stats,
)

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "six": six_turn_workflow,
    "thirty_five": thirty_five_turn_workflow,
    "interleaved": lambda seed: interleaved_run(seed, n_agents=4),
}
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def text_of(message: dict) -> str:
    calls = [c["function"]["arguments"] for c in message.get("tool_calls") or []]
    return "\n".join([message["content"] or "", *calls])


def check_workflow(wf: Workflow) -> None:
    """The invariants every workflow holds, whatever its shape and seed."""
    call_ids = Counter()
    for conv in wf.conversations:
        tools = {t["function"]["name"]: t["function"]["parameters"] for t in conv.tools}
        assert conv.messages[0]["role"] == "system" and conv.messages[1]["role"] == "user"
        for turn in conv.turns():
            earlier = "\n".join(text_of(m) for m in turn.request)
            for value in turn.copied:
                assert value in earlier, (conv.agent, turn.index, value)
                assert value in text_of(turn.reply), (conv.agent, turn.index, value)
            for call in turn.reply.get("tool_calls") or []:
                assert call["type"] == "function"
                name = call["function"]["name"]
                assert name in tools, (conv.agent, name)
                jsonschema.validate(json.loads(call["function"]["arguments"]), tools[name])
                call_ids[call["id"]] += 1
        assert conv.messages[-1]["role"] == "assistant" and conv.messages[-1]["content"]
        assert "tool_calls" not in conv.messages[-1]
    assert all(n == 1 for n in call_ids.values()), "tool call ids must be unique"
    answered = Counter(m["tool_call_id"] for c in wf.conversations for m in c.messages if m["role"] == "tool")
    assert answered == call_ids


def tool_results(wf: Workflow) -> list[int]:
    return [approx_tokens(m["content"]) for c in wf.conversations for m in c.messages if m["role"] == "tool"]


# sha256 of to_json(), recorded before the word lists moved from the module
# to experiments/workloads/data/workloads.json: the generator's output did not change,
# and any later edit of a pool or a draw shows here.
RECORDED = [
    (lambda: six_turn_workflow(0), "26ecc7406076f298aa9b52384e85e394b705d7909cf0e2f76764cac40058e2d7"),
    (lambda: thirty_five_turn_workflow(0), "c0b99d63e6007f6a03054f8a336e397ae51c9dadcaa3c5fcf934cfd2cd6247a1"),
    (lambda: interleaved_run(0, 4, 3), "41eb15216a99bd560d0f333fbd476cf9e3758ecbc85f0bd2bb0d7032b0d36b8c"),
]


@pytest.mark.parametrize("make,digest", RECORDED, ids=["six", "thirty_five", "interleaved"])
def test_workflows_are_the_recorded_bytes(make, digest):
    assert hashlib.sha256(make().to_json().encode()).hexdigest() == digest


@pytest.mark.parametrize("shape", SHAPES)
def test_same_seed_same_bytes_and_seeds_differ(shape):
    make = SHAPES[shape]
    assert make(3).to_json() == make(3).to_json()
    assert make(3).to_json() != make(4).to_json()


def test_bytes_do_not_depend_on_the_hash_seed(tmp_path):
    outputs = []
    for hash_seed in ("1", "2"):
        out = tmp_path / f"wf{hash_seed}.json"
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        cmd = [sys.executable, "-m", "agentkv.experiments.workloads.workflows", "--shape", "35", "--seed", "0",
               "--out", str(out)]
        printed = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
        assert "35 assistant turns" in printed
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_turn_counts(seed):
    for make, turns in ((six_turn_workflow, 6), (thirty_five_turn_workflow, 35)):
        wf = make(seed)
        assert len(list(wf.turns())) == len(wf.schedule) == turns
        assert sum(m["role"] == "assistant" for c in wf.conversations for m in c.messages) == turns
    wf = interleaved_run(seed, n_agents=3, turns_per_agent=5)
    assert len(wf.conversations) == 3 and len(list(wf.turns())) == 15


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 7, 123])
def test_invariants(shape, seed):
    check_workflow(SHAPES[shape](seed))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32))
def test_invariants_over_seeds(seed):
    check_workflow(six_turn_workflow(seed))


@pytest.mark.parametrize("seed", range(5))
def test_tool_sets(seed):
    for wf in (six_turn_workflow(seed), thirty_five_turn_workflow(seed)):
        for conv in wf.conversations:
            names = [t["function"]["name"] for t in conv.tools]
            assert 5 <= len(names) <= 20
            assert len(set(names)) == len(names) and all(TOOL_NAME.match(n) for n in names)
            assert 1000 <= approx_tokens(json.dumps(conv.tools)) <= 4000
            for tool in conv.tools:
                jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])


def test_a_token_counter_sets_the_budgets():
    def words(text: str) -> int:
        return len(text.split())

    wf = six_turn_workflow(0, count_tokens=words)
    assert all(1000 <= words(json.dumps(c.tools)) <= 4000 for c in wf.conversations)
    assert wf.to_json() != six_turn_workflow(0).to_json()


@pytest.mark.parametrize("seed", range(5))
def test_tool_result_lengths_span_the_range(seed):
    lengths = tool_results(thirty_five_turn_workflow(seed))
    assert min(lengths) < 100 and max(lengths) > 1000


def test_most_tool_calls_copy_from_context():
    wf = thirty_five_turn_workflow(0)
    call_turns = [t for t in wf.turns() if t.reply.get("tool_calls")]
    assert sum(bool(t.copied) for t in call_turns) >= 0.8 * len(call_turns)
    assert sum(len(t.copied) for t in call_turns) >= 2 * len(call_turns)


def test_turn_requests_are_the_history_before_the_reply():
    for turn in thirty_five_turn_workflow(1).turns():
        assert turn.request[0]["role"] == "system"
        assert turn.request[-1]["role"] in ("user", "tool")
        assert turn.reply["role"] == "assistant"


@pytest.mark.parametrize("shape", SHAPES)
def test_json_round_trip(shape):
    wf = SHAPES[shape](5)
    again = Workflow.from_json(wf.to_json())
    assert again == wf and again.to_json() == wf.to_json()


@pytest.mark.parametrize("make", [six_turn_workflow, thirty_five_turn_workflow])
def test_handoffs_carry_context_and_return_reports(make):
    wf = make(2)
    planner, workers = wf.conversations[0], wf.conversations[1:]
    assert planner.agent == "planner" and workers
    results = {m["tool_call_id"]: m["content"] for m in planner.messages if m["role"] == "tool"}
    reports = {w.messages[-1]["content"]: w for w in workers}
    calls = [c for m in planner.messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    handoffs = [(c, reports[results[c["id"]]]) for c in calls if results[c["id"]] in reports]
    assert [worker for _, worker in handoffs] == workers
    task = planner.messages[1]["content"]
    for call, worker in handoffs:
        args = json.loads(call["function"]["arguments"])
        opening = worker.messages[1]["content"]
        assert worker.role in args.values()
        assert task in opening
        assert any(isinstance(v, str) and opening.endswith(v) for v in args.values()), "the brief ends the hand-off"
    shared = os.path.commonprefix([c.system for c in wf.conversations])
    assert approx_tokens(shared) >= 300


def test_every_task_names_every_kind_of_copyable_value():
    for template in TASKS:
        assert all("{" + kind + "}" in template for kind in COPY_KINDS)


def test_interleaved_schedule_covers_every_agent_in_order():
    wf = interleaved_run(11, n_agents=5, turns_per_agent=4)
    assert {c.system for c in wf.conversations} == {wf.conversations[0].system}
    assert all(c.tools == wf.conversations[0].tools for c in wf.conversations)
    assert Counter(wf.schedule) == {c.agent: 4 for c in wf.conversations}
    assert wf.schedule != sorted(wf.schedule), "turns should interleave"
    seen = Counter()
    for turn in wf.turns():
        assert turn.index == seen[turn.agent]
        assert turn.reply is wf.conversation(turn.agent).messages[len(turn.request)]
        seen[turn.agent] += 1


def test_interleaved_run_rejects_empty_shapes():
    with pytest.raises(ValueError):
        interleaved_run(0, n_agents=0)


def test_turn_stats_count_what_is_new():
    wf = thirty_five_turn_workflow(0)
    rows = turn_stats(wf)
    assert len(rows) == 35
    for row in rows:
        assert 0 < row.new_tokens <= row.prompt_tokens
    later = [r for r in rows if r.messages > 2]
    assert sum(r.new_tokens for r in later) < 0.5 * sum(r.prompt_tokens for r in later)
