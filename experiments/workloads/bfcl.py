"""BFCL v4 (PyPI bfcl-eval, installed without its dependencies) as a
workload: its entries and answers, its function docs as OpenAI tools, and
its multi-turn conversations as live agent loops whose tool calls run on
BFCL's own executable classes (GorillaFileSystem, TradingBot, ...), scored
by bfcl's multi_turn_checker. experiments/benchmarks/eval_bfcl.py scores
models on it; experiments/workloads/bfcl_agents.py runs many such agents at
once. No BFCL item is used for anything but evaluation and workloads.
"""
from __future__ import annotations

import importlib
import json
import os
import random
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

# bfcl's config makes its result, score and lock folders when imported, beside
# the installed package unless told otherwise: keep them out of site-packages.
os.environ.setdefault("BFCL_PROJECT_ROOT", str(Path(tempfile.gettempdir()) / "bfcl_eval"))

from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING  # noqa: E402
from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import execute_multi_turn_func_call  # noqa: E402
from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry  # noqa: E402

AfterCalls = Callable[[list[dict]], object]  # called with a reply's calls once they ran (a tool pause)


@dataclass
class Reply:
    """One assistant reply: its text and its tool calls ({id, name, arguments: JSON text})."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)

    def message(self) -> dict:
        """The reply as the next request's assistant message."""
        out: dict = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in self.tool_calls]
        return out


Chat = Callable[[list[dict], list[dict]], Reply]  # (messages, tools) -> the model's reply


def tool_name(name: str) -> str:
    """OpenAI's names allow no "." (^[A-Za-z0-9_-]{1,64}$): BFCL sends "_"
    instead, and its checker expects the name changed the same way."""
    return name.replace(".", "_")


def openai_tools(functions: list[dict]) -> list[dict]:
    """BFCL's function docs as chat-completions tools, as bfcl's convert_to_tool
    makes them for OpenAI: its type names mapped to JSON Schema's (dict ->
    object, float -> number, tuple -> array, any -> string), nested
    properties and items too; a float parameter also says it is one. A
    function's response schema (multi-turn docs) goes into its description,
    as bfcl does for APIs that take no such field (this server's among them)."""
    tools = []
    for doc in functions:
        params = doc["parameters"]
        properties = {k: _schema(v, is_parameter=True) for k, v in params["properties"].items()}
        description = doc["description"]
        if "response" in doc:
            description += f" The response field has the following schema: {json.dumps(doc['response'])}"
        tools.append({"type": "function", "function": {
            "name": tool_name(doc["name"]), "description": description,
            "parameters": {**params, "type": "object", "properties": properties}}})
    return tools


def _schema(node: dict, is_parameter: bool) -> dict:
    kind = node.get("type")
    out = {**node, "type": GORILLA_TO_OPENAPI.get(kind, "string")}
    if kind == "float" and is_parameter:  # JSON Schema has one number type; BFCL marks the parameter's
        out["format"] = "float"
        out["description"] = node.get("description", "") + " This is a float type value."
    if "properties" in node:
        out["properties"] = {k: _schema(v, is_parameter=True) for k, v in node["properties"].items()}
    if "items" in node:
        out["items"] = _schema(node["items"], is_parameter=False)
    return out


def decode_calls(reply: Reply) -> list[dict]:
    """The reply's calls as BFCL's FC decoder gives them, [{name: arguments}];
    ValueError when an argument string is not a JSON object. A reply without
    tool_calls has none: BFCL's FC mode does not parse text."""
    calls = []
    for call in reply.tool_calls:
        args = json.loads(call["arguments"])
        if not isinstance(args, dict):
            raise ValueError(f"arguments of {call['name']} are not an object: {call['arguments']}")
        calls.append({call["name"]: args})
    return calls


def record(passed: bool, reason: str | None, calls: list) -> dict:
    """An item's verdict: passed, why not, the calls made."""
    return {"passed": passed, "reason": reason, "calls": calls}


def run_multi_turn(chat: Chat, entry: dict, ground_truth: list[list[str]], max_steps: int,
                   after_calls: AfterCalls | None = None) -> dict:
    """BFCL's multi-turn FC loop: each user turn appended, then the model's
    calls executed on the entry's classes and their results sent back as
    tool messages until it answers without a call (or max_steps replies
    with calls, which ends the conversation, as BFCL's step limit does);
    then bfcl's multi_turn_checker on the calls made. after_calls, when
    given, is called with each reply's calls once they ran."""
    # bfcl keeps each conversation's instances in a module global named after
    # the model and the entry: a fresh name gives this run fresh instances.
    tag = f"agentkv_{uuid.uuid4().hex}"
    execute = partial(execute_multi_turn_func_call, initial_config=entry["initial_config"],
                      involved_classes=entry["involved_classes"], model_name=tag, test_entry_id=entry["id"])
    tools, known = openai_tools(entry["function"]), {doc["name"] for doc in entry["function"]}
    messages: list[dict] = []
    turns: list[list[list[dict]]] = []  # per turn, per reply with calls, [{name: args}]
    for turn_messages in entry["question"]:
        messages += turn_messages
        steps, cut = _run_turn(chat, messages, tools, known, execute, max_steps, after_calls)
        turns.append(steps)
        if cut:
            break
    if len(turns) < len(ground_truth):
        return record(False, f"multi_turn:force_terminated: {max_steps} replies with calls in turn {len(turns) - 1}",
                       turns)
    executed = [[[call_string(c) for c in step if next(iter(c)) in known] for step in turn] for turn in turns]
    verdict = multi_turn_checker(executed, ground_truth, entry, entry["id"].rsplit("_", 1)[0], tag)
    reason = None if verdict["valid"] else f"{verdict['error_type']}: {verdict['error_message']}"
    return record(verdict["valid"], reason, turns)


def _run_turn(chat: Chat, messages: list[dict], tools: list[dict], known: set[str],
              execute: Callable, max_steps: int, after_calls: AfterCalls | None) -> tuple[list[list[dict]], bool]:
    """One user turn: (the calls of each reply that made some, whether max_steps cut it)."""
    steps: list[list[dict]] = []
    while len(steps) < max_steps:
        reply = chat(messages, tools)
        messages.append(reply.message())
        try:
            calls = decode_calls(reply)
        except ValueError:
            return steps, False  # BFCL ends the turn on a reply it cannot decode
        if not calls:
            return steps, False
        steps.append(calls)
        for call, result in zip(reply.tool_calls, [_execute(c, known, execute) for c in calls]):
            messages.append({"role": "tool", "content": result, "tool_call_id": call["id"]})
        if after_calls is not None:
            after_calls(calls)
    return steps, True


def _execute(call: dict, known: set[str], execute: Callable) -> str:
    """The call's result as BFCL's executor gives it (errors as text). bfcl
    evals the call as Python: only the classes' methods (the docs' names)
    reach it, anything else gets the error eval would give."""
    name = next(iter(call))
    if name not in known:
        return f"Error during execution: name '{name}' is not defined"
    results, _ = execute([call_string(call)])
    return results[0]


def call_string(call: dict) -> str:
    """{name: args} as the Python call bfcl executes; the arguments as one
    dict literal, so that the model's keys stay data, never code."""
    name, args = next(iter(call.items()))
    return f"{name}(**{args!r})"


# ---------------------------------------------------------------------------
# Entries


@dataclass
class Item:
    category: str
    entry: dict
    answer: Any  # possible answers (single-turn), ground-truth calls (multi-turn), None (irrelevance)


def load_items(category: str, limit: int | None, seed: int) -> list[Item]:
    """The category's entries (bfcl's loader: its function docs, multi-turn
    docs filled in) with their answers; limit: a seeded subset, in file order."""
    entries = load_dataset_entry(category)
    answers = {} if category == "irrelevance" else {
        a["id"]: a["ground_truth"] for a in load_ground_truth_entry(category)}
    if limit is not None and limit < len(entries):
        entries = [entries[i] for i in sorted(random.Random(seed).sample(range(len(entries)), limit))]
    return [Item(category, e, answers.get(e["id"])) for e in entries]


def tool_classes(entry: dict) -> dict[str, str]:
    """Each of the entry's function names -> the BFCL class that runs it."""
    out: dict[str, str] = {}
    for name in entry["involved_classes"]:
        cls = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[name]), name)
        out.update({doc["name"]: name for doc in entry["function"] if hasattr(cls, doc["name"])})
    return out
