"""Replayed agent trajectories: each agent's recorded conversation, sent
request by request with its whole history every time, as a real agent
framework sends it. The history holds the recorded replies and the real
tool outputs, never a system's own reply, so every system gets the
identical request stream whatever its model says: a replay measures
serving, not answers.

A Trace is one agent's conversation; request k sends every message before
its k-th assistant message (the recorded reply, which the client appends
after the server's reply is discarded). Builders of traces from
externally written tasks: experiments.workloads.bfcl_traces (BFCL v4's
multi-turn categories on BFCL's own classes) and
experiments.workloads.agentdojo_traces (AgentDojo's suites and their
ground-truth calls).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Trace:
    agent: str  # unique within a run
    family: str  # the task family, e.g. "bfcl-base", "bfcl-long", "agentdojo-workspace"
    group: str  # agents of one group share their prompt's head (system prompt, tools)
    tools: tuple[dict, ...]  # chat-completions tools, sent with every request
    messages: tuple[dict, ...]  # the whole recorded conversation, replies included

    def __post_init__(self) -> None:
        if not self.replies:
            raise ValueError(f"trace {self.agent} has no assistant message to replay")
        if self.replies[0] == 0:
            raise ValueError(f"trace {self.agent} begins with an assistant message")

    @property
    def replies(self) -> list[int]:
        """Indices of the recorded assistant messages: one request each."""
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]

    def __len__(self) -> int:
        return len(self.replies)

    def history(self, k: int) -> list[dict]:
        """What request k sends: every message before the k-th reply."""
        return list(self.messages[: self.replies[k]])

    def reply(self, k: int) -> dict:
        return self.messages[self.replies[k]]

    def called_tools(self, k: int) -> list[str]:
        """The names of the calls in reply k: what the agent runs before request k + 1."""
        return [c["function"]["name"] for c in self.reply(k).get("tool_calls") or []]


def request_body(trace: Trace, k: int, max_tokens: int, model: str) -> dict:
    """Request k as every system is sent it: greedy, exactly max_tokens
    generated (ignore_eos), the same body to the byte but the model name."""
    return {"model": model, "messages": trace.history(k), "tools": list(trace.tools), "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True}


def body_digest(body: dict) -> str:
    """sha256 of a request body's canonical JSON, the model name left out (each server names its own)."""
    canonical = json.dumps({k: v for k, v in body.items() if k != "model"}, sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def stream_digest(digests: dict[str, list[str]]) -> str:
    """One digest of a run's whole request stream: per agent, its requests'
    digests in the order sent (agents in name order: their interleaving is
    the servers' timing, not the stream)."""
    h = hashlib.sha256()
    for agent in sorted(digests):
        h.update(agent.encode() + b"\0" + "".join(digests[agent]).encode() + b"\n")
    return h.hexdigest()
