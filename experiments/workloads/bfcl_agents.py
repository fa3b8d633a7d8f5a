"""BFCL's multi-turn conversations as many live agents at once: the real
agents of the main job (experiments/benchmarks/demo.py).

Each agent is one multi_turn_base conversation (its first `turns` user
turns): it sends a user turn, every tool call the model makes runs on
BFCL's own classes built from the conversation's initial config (bfcl's
executor), each result goes back as a tool message, until the model answers
without a call or `max_steps` replies with calls end the conversation
(experiments.workloads.bfcl.run_multi_turn, the loop eval_bfcl scores).
After each reply's calls the agent pauses while its tools "run": a seeded
log-normal per tool class (agent_runs.Pauses), standing for remote tools.
At the end bfcl's multi_turn_checker says whether the agent's end state
matches the ground truth's.

Agents are drawn per role (a role is the set of classes a conversation
uses): agents of one role share their function docs, a prompt prefix of
4-9k tokens on SmolLM2's tokenizer, as agents of one deployment share a
system prompt.
"""
from __future__ import annotations

import ast
import json
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from agentkv.cache.tokens import common_prefix_len
from agentkv.experiments.workloads.agent_runs import AgentRecord, Client, OnTurn, Pauses, TurnRecord, reply_text
from agentkv.experiments.workloads.bfcl import (Reply, execute_multi_turn_func_call, load_items, openai_tools,
                                                run_multi_turn, tool_classes)

# Single-class roles with the shortest function docs (about 4.1k and 4.3k tokens on SmolLM2's tokenizer).
DEFAULT_ROLES = ("GorillaFileSystem", "TradingBot")


class RequestFailed(Exception):
    """A request of the agent's failed: it ends the agent's job."""


@dataclass
class BfclAgent:
    agent: str
    role: str  # the conversation's classes, "+"-joined
    entry: dict  # the BFCL entry, its question cut to the agent's turns
    ground_truth: list[list[str]]  # per turn, the calls bfcl expects (Python call strings)


def role_of(entry: dict) -> str:
    return "+".join(sorted(entry["involved_classes"]))


def pick_agents(n: int, turns: int, seed: int, roles: tuple[str, ...] = DEFAULT_ROLES) -> list[BfclAgent]:
    """n agents spread over `roles` in turn, each on its own conversation
    (drawn seeded among the role's that have at least `turns` user turns),
    cut to its first `turns` turns. A role whose conversations are all taken
    is passed over (BFCL has 13 such GorillaFileSystem conversations: 32
    agents over the default roles are 13 and 19). ValueError when the roles
    have too few in all."""
    by_role: dict[str, list] = {}
    for item in load_items("multi_turn_base", None, 0):
        if len(item.entry["question"]) >= turns:
            by_role.setdefault(role_of(item.entry), []).append(item)
    assigned: list[str] = []
    counts: Counter[str] = Counter()
    turn = 0
    for _ in range(n):
        for _ in roles:
            role = roles[turn % len(roles)]
            turn += 1
            if counts[role] < len(by_role.get(role, [])):
                break
        else:
            have = {r: len(by_role.get(r, [])) for r in roles}
            raise ValueError(f"the roles have {have} conversations of at least {turns} turns, {n} wanted in all; "
                             f"roles: {', '.join(sorted(by_role))}")
        counts[role] += 1
        assigned.append(role)
    drawn = {role: random.Random(f"{seed}/{role}").sample(by_role[role], k) for role, k in counts.items()}
    agents = []
    for i, role in enumerate(assigned):
        item = drawn[role].pop()
        entry = {**item.entry, "question": item.entry["question"][:turns]}
        agents.append(BfclAgent(f"a{i}-{entry['id']}", role_of(entry), entry, item.answer[:turns]))
    return agents


def parsed_call(call: str) -> tuple[str, dict]:
    """A ground-truth call string, name(k=v, ...), as (name, arguments)."""
    node = ast.parse(call, mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain call: {call}")
    return node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords}


def reference_messages(agent: BfclAgent, reply: str = "Done.") -> list[dict]:
    """The agent's conversation as the ground truth would run it: each turn's
    expected calls in one reply, their results from BFCL's executor, then a
    text reply; what sizes the run's working set before any model runs."""
    tag = f"agentkv_ref_{uuid.uuid4().hex}"
    messages: list[dict] = []
    for t, (turn, calls) in enumerate(zip(agent.entry["question"], agent.ground_truth)):
        messages += turn
        if calls:
            results, _ = execute_multi_turn_func_call(calls, agent.entry["initial_config"],
                                                      agent.entry["involved_classes"], tag, agent.entry["id"])
            ids = [f"ref{t}_{i}" for i in range(len(calls))]
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                for i, (name, args) in zip(ids, map(parsed_call, calls))]})
            messages += [{"role": "tool", "content": str(r), "tool_call_id": i} for i, r in zip(ids, results)]
        messages.append({"role": "assistant", "content": reply})
    return messages


def kv_budget(tokenizer, agents: list[BfclAgent], max_tokens: int, fraction: float, unit: int) -> dict:
    """The run's working set and a KV budget of `fraction` of it in whole
    units of `unit` tokens, as agent_runs.kv_budget gives them. An agent's
    part is its reference conversation (reference_messages) with its last
    reply at the cap; agents of one role share their function docs, held
    once in distinct_tokens. ValueError when the budget cannot hold the
    longest agent's reference conversation (a live one may run longer: its
    requests then fail, counted as errors)."""
    sizes, firsts = [], {}
    for a in agents:
        tools = openai_tools(a.entry["function"])
        sizes.append(len(tokenizer.apply_chat_template(reference_messages(a), tools=tools)) + max_tokens)
        firsts.setdefault(a.role, []).append(tokenizer.apply_chat_template(a.entry["question"][0], tools=tools))
    working_set = sum(sizes)
    shared = sum((len(ids) - 1) * min((common_prefix_len(ids[0], x) for x in ids[1:]), default=0)
                 for ids in firsts.values())
    tokens = int(working_set * fraction) // unit * unit
    if tokens < max(sizes):
        raise ValueError(f"a KV budget of {tokens} tokens ({fraction:.0%} of a working set of {working_set}) cannot "
                         f"hold the longest agent ({max(sizes)} tokens): raise the fraction or the agents")
    return {"working_set_tokens": working_set, "tokens": tokens, "headroom": tokens / working_set,
            "shared_prefix_tokens": shared, "distinct_tokens": working_set - shared,
            "longest_request_tokens": max(sizes)}


def run_bfcl_agent(agent: BfclAgent, client: Client, max_tokens: int, max_steps: int, pauses: Pauses,
                   on_request: OnTurn | None = None, t0: float | None = None) -> AgentRecord:
    """One agent's whole conversation, live; a failed request ends it (recorded)."""
    classes = tool_classes(agent.entry)
    requests: list[TurnRecord] = []
    start = time.perf_counter()
    t0 = start if t0 is None else t0

    def chat(messages: list[dict], tools: list[dict]) -> Reply:
        turn = sum(m["role"] == "user" for m in messages) - 1
        sent = time.perf_counter()
        try:
            r = client(agent.agent, messages, tools, max_tokens)
        except Exception as e:
            requests.append(TurnRecord(agent.agent, turn, time.perf_counter() - sent, 0.0, start_s=sent - t0,
                                       error=f"{type(e).__name__}: {e}"))
            raise RequestFailed from e
        finally:
            if on_request is not None:
                on_request()
        reply = Reply(r.text, [{"id": c["id"], "name": c["name"], "arguments": json.dumps(c["arguments"])}
                               for c in r.calls])
        requests.append(TurnRecord(agent.agent, turn, time.perf_counter() - sent, 0.0, r.prompt_tokens,
                                   r.cached_tokens, [c["name"] for c in r.calls], r.finish_reason,
                                   reply_text(reply.message()), completion_tokens=r.completion_tokens,
                                   start_s=sent - t0, queued_s=r.queued_s))
        return reply

    def pause(calls: list[dict]) -> None:
        # Seeded by the agent and the request, so a run's pauses do not depend on thread timing.
        seconds = pauses.draw(agent.agent, len(requests), [classes.get(next(iter(c)), "unknown") for c in calls])
        requests[-1].pause_s = seconds
        time.sleep(seconds)

    try:
        verdict = run_multi_turn(chat, agent.entry, agent.ground_truth, max_steps, after_calls=pause)
        passed, reason = verdict["passed"], verdict["reason"]
    except RequestFailed:  # recorded on the request
        passed, reason = False, "a request failed"
    return AgentRecord(agent.agent, len(agent.entry["question"]), time.perf_counter() - start, requests,
                       passed, reason)
