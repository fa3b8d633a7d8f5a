"""AgentDojo's benign user tasks as replayed trajectories
(experiments.workloads.traces). AgentDojo (PyPI `agentdojo`, MIT) gives
four suites (workspace, travel, banking, slack), each a set of tools over a
stateful environment and user tasks with their ground-truth calls.

An agent's conversation is AgentDojo's default system message, then
`user_turns` of its suite's user tasks drawn without repeats, each as: the
task's prompt, one assistant message per ground-truth call, each followed by
the call's real result on the agent's own environment (the suite's default,
benign environment, changed by the calls before it), formatted as
AgentDojo's pipeline formats tool results (YAML), then a short text reply
(the task's ground-truth output, else "Done."). No injection task or attack
text is ever used. A task whose ground truth no longer applies to the state
left by the tasks before it is passed over for the next one drawn.

Agents of one suite share its system message and tools (group = suite).
Workspace tool outputs (emails, files, calendars) are large but uneven
(from a few hundred characters to 59k a task): rendered with the default
model's chat template, the system message and tools are some 4k tokens, and
8 workspace agents (seed 0) reach 4.8k-23k tokens at user_turns=2 (one of
8 past 8k), 6.0k-24k at 3 (three), 6.2k-25k at 4 (five) and 12.6k-27k at 8
(all); at the default 7, 192 agents over four seeds all passed 8k (8.4k to
39k, median about 18k). Travel, banking and slack outputs are far shorter.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import random
import types
from collections.abc import Iterator
from unittest import mock

from agentdojo.agent_pipeline.agent_pipeline import load_system_message
from agentdojo.agent_pipeline.tool_execution import tool_result_to_str
from agentdojo.base_tasks import BaseUserTask
from agentdojo.default_suites.v1.tools import calendar_client, cloud_drive_client, email_client
from agentdojo.functions_runtime import Function, FunctionsRuntime, TaskEnvironment
from agentdojo.task_suite.load_suites import get_suite
from agentdojo.task_suite.task_suite import TaskSuite

from agentkv.experiments.workloads.traces import Trace

SUITES = ("workspace", "travel", "banking", "slack")
BENCHMARK_VERSION = "v1.2.2"  # agentdojo's own default benchmark version
DEFAULT_USER_TURNS = 7  # the fewest that brought every workspace agent we drew past 8k tokens
# The workspace calendar's current day: what an agent writes is dated in the suites' own present.
FIXED_NOW = datetime.datetime(2024, 5, 15, 12, 0)


class TaskNotApplicable(Exception):
    """A task's ground truth fails on the state the tasks before it left."""


@contextlib.contextmanager
def reproducible_tools() -> Iterator[None]:
    """The email and drive clients stamp what they write with the wall
    clock, and the calendar dedups participants through a set, whose order
    follows the per-process string hash: both fixed so that a build is the
    same byte for byte in any process."""
    clock = types.SimpleNamespace(datetime=types.SimpleNamespace(now=lambda: FIXED_NOW))
    with (mock.patch.object(email_client, "datetime", clock), mock.patch.object(cloud_drive_client, "datetime", clock),
          mock.patch.object(calendar_client, "set", dict.fromkeys, create=True)):
        yield


def openai_tool(function: Function) -> dict:
    """A suite function as a chat-completions tool, as AgentDojo's OpenAI pipeline declares it."""
    return {"type": "function", "function": {"name": function.name, "description": function.description,
                                             "parameters": function.parameters.model_json_schema()}}


def run_task(task: BaseUserTask, runtime: FunctionsRuntime, env: TaskEnvironment, agent: int, first_call: int
             ) -> list[dict]:
    """One user task on `env` (changed in place) as messages: prompt, each
    ground-truth call (ids call_<agent>_<n>, n from first_call) and its
    formatted result, the closing reply. TaskNotApplicable when a call fails
    on this state."""
    messages: list[dict] = [{"role": "user", "content": task.PROMPT}]
    with reproducible_tools():
        try:
            calls = task.ground_truth(env)
        except Exception as e:  # the task's own lookups: the state lacks what it expects
            raise TaskNotApplicable(f"{task.ID}: no ground truth on this state: {e!r}") from e
        for n, call in enumerate(calls, first_call):
            try:
                result, _ = runtime.run_function(env, call.function, call.args, raise_on_error=True)
            except Exception as e:  # any tool's own error, likewise
                raise TaskNotApplicable(f"{task.ID}: {call.function} failed: {e!r}") from e
            call_id = f"call_{agent}_{n}"
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": call.function, "arguments": json.dumps(dict(call.args))}}]})
            messages.append({"role": "tool", "content": tool_result_to_str(result), "tool_call_id": call_id})
    messages.append({"role": "assistant", "content": task.GROUND_TRUTH_OUTPUT or "Done."})
    return messages


def agentdojo_trace(suite: TaskSuite, index: int, seed: int, user_turns: int) -> Trace:
    """Agent `index` of `suite`: user_turns tasks drawn seeded by (seed,
    suite, index), each on the environment the previous ones left.
    ValueError when fewer tasks than that apply in turn."""
    tasks = sorted(suite.user_tasks.values(), key=lambda t: int(t.ID.rsplit("_", 1)[1]))
    random.Random(f"{seed}/{suite.name}/{index}").shuffle(tasks)
    runtime = FunctionsRuntime(suite.tools)
    env = suite.load_and_inject_default_environment({})  # the injection vectors' benign defaults
    messages: list[dict] = [{"role": "system", "content": load_system_message(None)}]
    taken = 0
    for task in tasks:
        if taken == user_turns:
            break
        trial = task.init_environment(env.model_copy(deep=True))
        try:
            messages += run_task(task, runtime, trial, index, sum(m["role"] == "tool" for m in messages))
        except TaskNotApplicable:
            continue
        env, taken = trial, taken + 1
    if taken < user_turns:
        raise ValueError(f"only {taken} of {suite.name}'s tasks apply in turn, {user_turns} wanted")
    family = f"agentdojo-{suite.name}"
    return Trace(f"{family}-{index}", family, suite.name, tuple(openai_tool(f) for f in suite.tools),
                 tuple(messages))


def agentdojo_traces(n: int, seed: int, suites: tuple[str, ...] = ("workspace",),
                     user_turns: int = DEFAULT_USER_TURNS) -> list[Trace]:
    """n agents over `suites` in turn, each working through user_turns of
    its suite's user tasks in one conversation. The same (n, seed) give the
    same traces byte for byte."""
    unknown = sorted(set(suites) - set(SUITES))
    if unknown or not suites:
        raise ValueError(f"suites must be a non-empty subset of {SUITES}, not {suites!r}")
    if n < 0 or user_turns < 1:
        raise ValueError(f"n must be >= 0 and user_turns >= 1, not n={n}, user_turns={user_turns}")
    loaded = {name: get_suite(BENCHMARK_VERSION, name) for name in suites}
    return [agentdojo_trace(loaded[suites[i % len(suites)]], i, seed, user_turns) for i in range(n)]
