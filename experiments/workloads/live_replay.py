"""Live replay: a workflow whose assistant messages are the model's own.

The model serves the workflow once, turn by turn in its schedule, each agent
with a persistent session; every reply it writes (text and parsed tool calls)
replaces the reference reply in that agent's history, so later turns re-send
what the model said, as an agent framework would. Tool results stay the
workflow's: the tools are simulated, and a model that calls a different tool
still gets the scripted answer. A turn whose prompt and reply would not fit
the model's context keeps its reference reply (the replay leaves it out).

The returned workflow is then replayed teacher-forced by every benchmarked
system: same weights and greedy decoding reproduce these replies, so each
system does the work of the live run, and the n-gram drafter meets the
model's own copies from context, not a reference text's.
"""
from __future__ import annotations

import copy
import json

from tqdm import tqdm

from agentkv import Engine
from agentkv.experiments.workloads.workflows import Conversation, Workflow


def as_message(text: str, calls: list[dict], reference: dict) -> dict:
    """The reply as an OpenAI assistant message; call ids follow the
    reference's so the scripted tool results still answer them."""
    ref_ids = [c["id"] for c in reference.get("tool_calls") or []]
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"id": ref_ids[i] if i < len(ref_ids) else c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for i, c in enumerate(calls)
        ]
    return message


def live_workflow(engine: Engine, wf: Workflow, max_gen: int, max_turns: int | None = None) -> Workflow:
    """Serve wf with `engine` (greedy, replies up to max_gen tokens) and return
    it with each served assistant message replaced by the model's reply."""
    conversations = {c.agent: Conversation(c.agent, c.role, c.tools, copy.deepcopy(c.messages), c.copied)
                     for c in wf.conversations}
    sessions = {agent: engine.session() for agent in conversations}
    # Index of each agent's next assistant message in its own transcript.
    cursor = {agent: 0 for agent in conversations}
    schedule = wf.schedule[:max_turns] if max_turns is not None else wf.schedule
    try:
        for agent in tqdm(schedule, desc="live transcript", unit="turn"):
            conv = conversations[agent]
            at = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"][cursor[agent]]
            cursor[agent] += 1
            prompt = engine.tokenizer.apply_chat_template(conv.messages[:at], tools=conv.tools, add_generation_prompt=True)
            if len(prompt) >= engine.max_context:  # no system could serve it: the replay leaves it out
                continue
            result = engine.chat(conv.messages[:at], tools=conv.tools, session=sessions[agent], max_tokens=max_gen,
                                 temperature=0.0)
            conv.messages[at] = as_message(result.text, result.tool_calls, conv.messages[at])
    finally:
        for s in sessions.values():
            s.close()
    return Workflow(wf.shape, wf.seed, [conversations[c.agent] for c in wf.conversations], list(wf.schedule))
