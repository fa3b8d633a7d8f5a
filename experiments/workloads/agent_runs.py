"""Many agents at once, each pausing while its tools run: the workload and
the runner that experiments/benchmarks/bench_agents.py (over HTTP) and
experiments/benchmarks/demo.py (in-process) share.

The workload is experiments.workloads.workflows.interleaved_run: N agents of one role
sharing a system prompt and tool set (a long common prefix), each on its
own task, each with the same number of turns. Every agent runs in its own
thread, all starting together, turn after turn:

- Live mode: the agent re-sends its history with the model's own earlier
  replies in it (as an agent framework does), and the workload's reference
  tool results after them (the tools are simulated: a model that called a
  different tool still gets the scripted result; call ids follow the
  reference's, experiments.workloads.live_replay). Decoding is greedy with a fixed
  max_tokens cap, so a run is deterministic for a system, and the number of
  turns is the workload's whatever the model says.
- Tool pauses: after a turn that called tools the agent sleeps while they
  "run". Each tool name has its own log-normal duration (a median drawn
  log-uniformly from 0.5 s to 8 s, sigma 0.6, clipped to 0.2 s to 20 s, times
  a scale), seeded by the run's seed, the agent, its turn and the tool, so
  they do not depend on thread timing. Parallel calls run together:
  the turn pauses for the longest. The tools are the model's own calls when
  it made any (what a framework would run, and what a server that learns
  pause times per tool name sees), else the reference reply's.

A client is any callable(agent, messages, tools, max_tokens) -> Reply; the
runner times each call (queueing included) and each agent's whole job.
"""
from __future__ import annotations

import copy
import json
import math
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Callable

from agentkv.cache.tokens import common_prefix_len
from agentkv.experiments.common import median
from agentkv.experiments.drivers.replay import prepare_requests
from agentkv.experiments.drivers.system import kv_tokens_needed
from agentkv.experiments.workloads.live_replay import as_message
from agentkv.experiments.workloads.workflows import Conversation, Workflow, interleaved_run

PAUSE_MEDIAN_RANGE = (0.5, 8.0)  # seconds: each tool's median is drawn log-uniformly from here
PAUSE_SIGMA = 0.6
PAUSE_CLIP = (0.2, 20.0)


@dataclass
class Reply:
    """What one turn got back: the reply's text and calls ({"id", "name", "arguments": dict}) and its usage."""

    text: str | None
    calls: list[dict]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str
    completion_tokens: int = 0
    queued_s: float = 0.0  # the server's own queueing before admission, where it reports it


Client = Callable[[str, list[dict], list[dict], int], Reply]
OnTurn = Callable[[], object]  # called after every turn (a progress bar's update)


@dataclass
class TurnRecord:
    agent: str
    turn: int
    latency_s: float  # the call's wall time, queueing included
    pause_s: float  # the tool pause that followed (0 after the last turn)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tools: list[str] = field(default_factory=list)  # the calls the model made
    finish_reason: str = ""
    text: str = ""  # the reply as it went into the history (text and calls), to compare systems
    error: str | None = None
    completion_tokens: int = 0
    start_s: float = 0.0  # when the call was sent, from the run's start
    queued_s: float = 0.0  # of latency_s, waiting for admission (where the server reports it)


@dataclass
class AgentRecord:
    agent: str
    planned_turns: int
    job_s: float  # from the agent's start to its last reply (or its failure)
    turns: list[TurnRecord]  # one per request
    passed: bool | None = None  # the job's outcome where the workload checks it (BFCL's end state)
    reason: str | None = None  # why it did not pass

    @property
    def errors(self) -> list[str]:
        return [t.error for t in self.turns if t.error]


class Pauses:
    """Seeded tool pauses: a log-normal per tool name, scaled by `scale`."""

    def __init__(self, seed: int, scale: float = 1.0):
        self.seed, self.scale = seed, scale

    def median(self, tool: str) -> float:
        lo, hi = PAUSE_MEDIAN_RANGE
        u = random.Random(f"{self.seed}/tool/{tool}").random()
        return math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))

    def draw(self, agent: str, turn: int, tools: list[str]) -> float:
        """Seconds the turn's tools run; parallel calls overlap."""
        if not tools or self.scale <= 0:
            return 0.0
        lo, hi = PAUSE_CLIP
        draws = [random.Random(f"{self.seed}/{agent}/{turn}/{t}").lognormvariate(math.log(self.median(t)), PAUSE_SIGMA)
                 for t in tools]
        return self.scale * max(min(max(d, lo), hi) for d in draws)


def plan(seed: int, agents: int, turns_per_agent: int) -> Workflow:
    return interleaved_run(seed, n_agents=agents, turns_per_agent=turns_per_agent)


def kv_budget(tokenizer, wf: Workflow, max_tokens: int, fraction: float, unit: int) -> dict:
    """The run's working set and a KV budget of `fraction` of it in whole
    units of `unit` tokens. The working set is the sum over agents of their
    largest prompt + reply, from the reference transcript with replies capped
    at max_tokens (a live run's differ a little); distinct_tokens counts the
    agents' shared prefix once. ValueError when the budget
    cannot hold the longest request a live run may send: its reference prompt
    with every earlier reply and its own at the cap."""
    reqs = prepare_requests(tokenizer, wf, None, max_tokens)
    working_set = kv_tokens_needed(reqs)
    # The agents share a system prompt and tools: held once, the working set is smaller.
    firsts = [r.ids for r in reqs if r.agent_turn == 0]
    shared = min((common_prefix_len(firsts[0], ids) for ids in firsts[1:]), default=0)
    longest = max(len(r.ids) + (r.agent_turn + 1) * max_tokens for r in reqs)
    tokens = int(working_set * fraction) // unit * unit
    if tokens < longest:
        raise ValueError(f"a KV budget of {tokens} tokens ({fraction:.0%} of a working set of {working_set}) cannot "
                         f"hold the longest request ({longest} tokens): raise the fraction or the agents")
    return {"working_set_tokens": working_set, "tokens": tokens, "headroom": tokens / working_set,
            "shared_prefix_tokens": shared, "distinct_tokens": working_set - (len(firsts) - 1) * shared,
            "longest_request_tokens": longest}


def reply_text(message: dict) -> str:
    """An assistant message as text and calls, for comparing systems' replies."""
    calls = [f"{c['function']['name']}({c['function']['arguments']})" for c in message.get("tool_calls") or []]
    return "\n".join([message.get("content") or "", *calls])


def run_agent(conv: Conversation, client: Client, max_tokens: int, pauses: Pauses,
              on_turn: OnTurn | None = None, t0: float | None = None) -> AgentRecord:
    """One agent's whole job, live: its turns in order, pausing after each
    tool turn; t0 is the run's start (perf_counter), the agent's own by default."""
    messages = copy.deepcopy(conv.messages)
    at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    turns: list[TurnRecord] = []
    start = time.perf_counter()
    t0 = start if t0 is None else t0
    for k, i in enumerate(at):
        sent = time.perf_counter()
        try:
            r = client(conv.agent, messages[:i], conv.tools, max_tokens)
            latency = time.perf_counter() - sent
            messages[i] = as_message(r.text, r.calls, messages[i])
        except Exception as e:  # noqa: BLE001 - a failed turn ends this agent's job, recorded
            turns.append(TurnRecord(conv.agent, k, time.perf_counter() - sent, 0.0, error=f"{type(e).__name__}: {e}",
                                    start_s=sent - t0))
            break
        finally:
            if on_turn is not None:
                on_turn()
        called = [c["name"] for c in r.calls]
        reference = [c["function"]["name"] for c in conv.messages[i].get("tool_calls") or []]
        pause = pauses.draw(conv.agent, k, called or reference) if k + 1 < len(at) else 0.0
        turns.append(TurnRecord(conv.agent, k, latency, pause, r.prompt_tokens, r.cached_tokens, called,
                                r.finish_reason, reply_text(messages[i]), completion_tokens=r.completion_tokens,
                                start_s=sent - t0, queued_s=r.queued_s))
        time.sleep(pause)
    return AgentRecord(conv.agent, len(at), time.perf_counter() - start, turns)


def run_agents(wf: Workflow, client: Client, max_tokens: int, pauses: Pauses,
               on_turn: OnTurn | None = None) -> tuple[list[AgentRecord], float]:
    """Every agent in its own thread, all started together. Returns their
    records (in the workflow's order) and the wall time of the whole run."""
    return run_all({c.agent: partial(run_agent, c, client, max_tokens, pauses, on_turn) for c in wf.conversations})


Job = Callable[..., AgentRecord]  # job(t0=the run's start) -> the agent's record


def run_all(jobs: dict[str, Job]) -> tuple[list[AgentRecord], float]:
    """Each agent's job in its own thread, all started together. Returns
    their records (in the jobs' order) and the wall time of the whole run."""
    records: dict[str, AgentRecord] = {}
    start = time.perf_counter()

    def one(agent: str) -> None:
        records[agent] = jobs[agent](t0=start)

    threads = [threading.Thread(target=one, args=(a,), name=f"agent-{a}") for a in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [records[a] for a in jobs], time.perf_counter() - start


def p90(xs: list[float]) -> float:
    """The 90th percentile (inclusive method); the value itself for one sample."""
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=10, method="inclusive")[8]


def summarize(records: list[AgentRecord], wall_s: float) -> dict:
    """Job completion per agent, per-request latency, tokens reused and
    computed (from usage), errors, and where the workload checks jobs, how
    many passed. A turn is a user turn; it may take several requests."""
    turns = [t for r in records for t in r.turns if not t.error]
    jobs = [r.job_s for r in records if not r.errors]
    # A job's first request computes its shared system prompt on every
    # system; its later ones are where kept KV pays: their sum per agent.
    whole = [r for r in records if not r.errors and r.turns]
    firsts = [r.turns[0].latency_s for r in whole]
    laters = [sum(t.latency_s for t in r.turns[1:]) for r in whole]
    pauses = [t.pause_s for t in turns if t.pause_s > 0]
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    checked = [r.passed for r in records if r.passed is not None]
    return {
        "planned_turns": sum(r.planned_turns for r in records),
        "completed_turns": len({(t.agent, t.turn) for t in turns}),
        "requests": len(turns),
        "queued_s_total": sum(t.queued_s for t in turns),
        "jobs_passed": sum(checked) if checked else None,
        "jobs_checked": len(checked),
        "errors": [e for r in records for e in r.errors],
        "job_s_median": median(jobs),
        "job_s_p90": p90(jobs),
        "first_request_s_median": median(firsts),
        "later_requests_s_median": median(laters),
        "turn_s_p50": median([t.latency_s for t in turns]),
        "turn_s_p90": p90([t.latency_s for t in turns]),
        "pause_s_total": sum(pauses),
        "pause_s_min": min(pauses, default=0.0),
        "pause_s_median": statistics.median(pauses) if pauses else 0.0,
        "pause_s_max": max(pauses, default=0.0),
        "prompt_tokens": prompt,
        "reused_tokens": cached,
        "computed_tokens_usage": prompt - cached,
        "tool_turns": sum(1 for t in turns if t.tools),
        "wall_s": wall_s,
    }


def records_json(records: list[AgentRecord]) -> list[dict]:
    return [{**asdict(r), "errors": r.errors} for r in records]


def openai_reply(response) -> Reply:
    """A chat completion from the openai client as a Reply."""
    choice = response.choices[0]
    calls = [{"id": c.id, "name": c.function.name, "arguments": json.loads(c.function.arguments)}
             for c in choice.message.tool_calls or []]
    usage = response.usage
    details = getattr(usage, "prompt_tokens_details", None)
    cached = (getattr(details, "cached_tokens", None) or 0) if details is not None else 0
    return Reply(choice.message.content, calls, usage.prompt_tokens, cached, choice.finish_reason,
                 usage.completion_tokens)
