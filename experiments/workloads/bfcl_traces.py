"""BFCL v4's multi-turn conversations as replayed trajectories
(experiments.workloads.traces): every user turn of the entry, each
turn's ground-truth calls in one assistant reply, their results as BFCL's
own classes give them (bfcl's executor on the entry's initial config), then
a short text reply closing the turn. multi_turn_long_context is the same
tasks over file systems and records with long contents: its tool outputs
make each agent's private context several thousand tokens.

Agents are spread over roles (a role is the set of classes a conversation
uses, whose function docs are its prompt's head): agents of one role share
that head, as agents of one deployment share a system prompt.
"""
from __future__ import annotations

import json
import random
import uuid
from collections import Counter

from agentkv.experiments.workloads.bfcl import execute_multi_turn_func_call, load_items, openai_tools, tool_name
from agentkv.experiments.workloads.bfcl_agents import DEFAULT_ROLES, parsed_call, role_of
from agentkv.experiments.workloads.traces import Trace

CATEGORIES = {"bfcl-base": "multi_turn_base", "bfcl-long": "multi_turn_long_context"}


def turn_reply(calls: list[str]) -> str:
    """The recorded text that closes a turn: what was done, deterministic."""
    if not calls:
        return "There is nothing I can do for that with these tools."
    return "Done: " + ", ".join(calls) + "."


def bfcl_trace(family: str, item, agent: str) -> Trace:
    """One BFCL entry, all its user turns, replayed with its ground truth."""
    entry = item.entry
    tag = f"agentkv_trace_{uuid.uuid4().hex}"  # fresh class instances for this conversation
    messages: list[dict] = []
    for t, (turn, calls) in enumerate(zip(entry["question"], item.answer)):
        messages += turn
        if calls:
            results, _ = execute_multi_turn_func_call(calls, entry["initial_config"], entry["involved_classes"], tag,
                                                      entry["id"], long_context=family == "bfcl-long")
            ids = [f"call_{t}_{i}" for i in range(len(calls))]
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": tool_name(name), "arguments": json.dumps(args)}}
                for i, (name, args) in zip(ids, map(parsed_call, calls))]})
            messages += [{"role": "tool", "content": str(r), "tool_call_id": i} for i, r in zip(ids, results)]
        messages.append({"role": "assistant", "content": turn_reply(calls)})
    return Trace(agent, family, role_of(entry), tuple(openai_tools(entry["function"])), tuple(messages))


def bfcl_traces(family: str, n: int, seed: int, roles: tuple[str, ...] = DEFAULT_ROLES) -> list[Trace]:
    """n agents over `roles` in turn, each on its own conversation of the
    family's category, drawn seeded per role. ValueError when the roles hold
    fewer conversations than asked for."""
    if family not in CATEGORIES:
        raise ValueError(f"family must be one of {sorted(CATEGORIES)}, not {family!r}")
    by_role: dict[str, list] = {}
    for item in load_items(CATEGORIES[family], None, 0):
        by_role.setdefault(role_of(item.entry), []).append(item)
    have = {r: len(by_role.get(r, [])) for r in roles}
    if n > sum(have.values()):
        raise ValueError(f"{n} agents wanted, the roles have {have} conversations")
    counts: Counter[str] = Counter()
    assigned: list[str] = []
    turn = 0
    while len(assigned) < n:
        role = roles[turn % len(roles)]
        turn += 1
        if counts[role] < have[role]:
            counts[role] += 1
            assigned.append(role)
    drawn = {role: random.Random(f"{seed}/{family}/{role}").sample(by_role[role], k) for role, k in counts.items()}
    return [bfcl_trace(family, drawn[role].pop(), f"{family}-{i}") for i, role in enumerate(assigned)]
