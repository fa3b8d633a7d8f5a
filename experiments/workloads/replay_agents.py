"""Many agents replaying their recorded trajectories at once
(experiments.workloads.traces), each pausing while its tools run.

Each agent is a thread: it sends request k (its whole history, greedy,
exactly max_tokens generated), discards the reply, and when the recorded
reply called tools it sleeps while they "run" before request k + 1. A user
turn that follows a final answer is sent at once. So every system gets the
same requests in the same order per agent; only their interleaving
depends on the servers' speed.

Tool pauses are seeded log-normals fitted to a published statistic of real
agents' tool calls: SyFI TraceLab (University of Washington), the
per-call tool execution latency over 432k tool calls of Claude Code and
Codex sessions, p50 0.3 s, p90 13.6 s, p99 3.6 min
(https://tracelab.cs.washington.edu/exp/session/session_timing_distribution/,
the paper's tab:timing_distribution). The log-normal with that median and
p90 is clipped at the published p99. Parallel calls run together: the
pause is the longest draw.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agentkv.experiments.workloads.agent_runs import AgentRecord, Job, OnTurn, Reply, TurnRecord, reply_text
from agentkv.experiments.workloads.traces import Trace, body_digest, request_body

PAUSE_SOURCE = ("SyFI TraceLab, tool execution per call (Claude Code and Codex traces): p50 0.3 s, p90 13.6 s, "
                "p99 3.6 min; https://tracelab.cs.washington.edu/exp/session/session_timing_distribution/")
PAUSE_MEDIAN_S = 0.3
PAUSE_P90_S = 13.6
PAUSE_P99_S = 216.0
Z90 = 1.2815515655446004  # the standard normal's 90th percentile


class TracePauses:
    """Seeded tool pauses from the published distribution, times `scale`."""

    def __init__(self, seed: int, scale: float = 1.0, median_s: float = PAUSE_MEDIAN_S, p90_s: float = PAUSE_P90_S,
                 cap_s: float = PAUSE_P99_S):
        if scale < 0 or median_s <= 0 or p90_s <= median_s or cap_s <= 0:
            raise ValueError("pauses need scale >= 0, 0 < median < p90 and a positive cap")
        self.seed, self.scale, self.cap_s = seed, scale, cap_s
        self.mu, self.sigma = math.log(median_s), math.log(p90_s / median_s) / Z90

    def draw(self, agent: str, k: int, tools: list[str]) -> float:
        """Seconds the tools called by agent's reply k run (0 without calls).
        Seeded by the run, the agent, the request and the call, so that it
        is the same on every system whatever the threads' timing."""
        if not tools or self.scale == 0:
            return 0.0
        draws = [random.Random(f"{self.seed}/{agent}/{k}/{i}/{t}").lognormvariate(self.mu, self.sigma)
                 for i, t in enumerate(tools)]
        return self.scale * min(max(draws), self.cap_s)


Send = Callable[[str, dict], Reply]  # (agent, request body) -> the server's reply


@dataclass
class Sent:
    """The digests of every request body sent, per agent, in order: what
    shows that two systems got the same stream."""

    digests: dict[str, list[str]] = field(default_factory=dict)

    def add(self, agent: str, body: dict) -> None:
        self.digests.setdefault(agent, []).append(body_digest(body))


def replay_job(trace: Trace, send: Send, max_tokens: int, pauses: TracePauses, model: str, sent: Sent,
               on_request: OnTurn | None = None) -> Job:
    """The agent's job: job(t0=the run's start) -> its record. A failed
    request ends the agent's job (recorded)."""

    def job(t0: float | None = None) -> AgentRecord:
        turns: list[TurnRecord] = []
        start = time.perf_counter()
        t0 = start if t0 is None else t0
        for k in range(len(trace)):
            body = request_body(trace, k, max_tokens, model)
            user_turn = sum(m["role"] == "user" for m in body["messages"]) - 1
            sent.add(trace.agent, body)
            at = time.perf_counter()
            try:
                r = send(trace.agent, body)
            except Exception as e:  # noqa: BLE001 - recorded; it ends this agent's job
                turns.append(TurnRecord(trace.agent, user_turn, time.perf_counter() - at, 0.0,
                                        error=f"{type(e).__name__}: {e}", start_s=at - t0))
                break
            finally:
                if on_request is not None:
                    on_request()
            latency = time.perf_counter() - at
            tools = trace.called_tools(k)
            pause = pauses.draw(trace.agent, k, tools) if k + 1 < len(trace) else 0.0
            turns.append(TurnRecord(trace.agent, user_turn, latency, pause, r.prompt_tokens, r.cached_tokens, tools,
                                    r.finish_reason, reply_text({"content": r.text, "tool_calls": [
                                        {"function": c} for c in r.calls]}),
                                    completion_tokens=r.completion_tokens, start_s=at - t0, queued_s=r.queued_s))
            time.sleep(pause)
        return AgentRecord(trace.agent, len(trace), time.perf_counter() - start, turns)

    return job


def openai_send(base_url: str, session_ids: bool, run_tag: str) -> Send:
    """Requests over the openai client, one client per agent (made in its
    thread). With session_ids, each agent's requests carry its session in
    the X-Session-Id header, so the body stays the same for every system;
    ignore_eos goes in the body as vLLM and this server both read it."""
    import openai

    clients: dict[str, openai.OpenAI] = {}

    def send(agent: str, body: dict) -> Reply:
        client = clients.get(agent)
        if client is None:
            client = clients[agent] = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=1800)
        headers = {"X-Session-Id": f"{run_tag}-{agent}"} if session_ids else None
        standard = {k: v for k, v in body.items() if k != "ignore_eos"}
        return lenient_reply(client.chat.completions.create(**standard, extra_body={"ignore_eos": body["ignore_eos"]},
                                                            extra_headers=headers))

    return send


def lenient_reply(response) -> Reply:
    """A chat completion as a Reply, its calls' arguments kept as sent: a
    replay discards the reply, and a call cut at max_tokens is no error."""
    choice, usage = response.choices[0], response.usage
    details = getattr(usage, "prompt_tokens_details", None)
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or []]
    return Reply(choice.message.content, calls, usage.prompt_tokens, getattr(details, "cached_tokens", None) or 0,
                 choice.finish_reason, usage.completion_tokens)
