"""Which agents a many-agents run serves, what they cost in KV and the job
each one runs against a client: BFCL's multi-turn agents
(experiments/workloads/bfcl_agents.py) or the generated workflows
(experiments/workloads/agent_runs.py). The demo (in-process) and
bench_agents (over HTTP) both take their agents from here."""
from __future__ import annotations

from collections import Counter
from functools import partial

from agentkv.experiments.workloads import agent_runs
from agentkv.experiments.workloads.agent_runs import Client, Job, OnTurn, Pauses, run_agent

KINDS = ("bfcl", "generated")


class AgentWorkload:
    def __init__(self, kind: str, n_agents: int, turns: int, seed: int, max_tokens: int, pauses: Pauses,
                 max_steps: int = 4, roles: tuple[str, ...] | None = None):
        """kind: one of KINDS; turns: user turns per agent; max_steps (bfcl):
        replies with calls per user turn before it is cut; roles (bfcl): the
        agents' BFCL classes (bfcl_agents.DEFAULT_ROLES by default)."""
        if kind not in KINDS:
            raise ValueError(f"workload must be one of {KINDS}, got {kind!r}")
        self.kind, self.max_tokens, self.max_steps, self.pauses = kind, max_tokens, max_steps, pauses
        if kind == "bfcl":
            from agentkv.experiments.workloads import bfcl_agents  # bfcl-eval is installed apart (README)

            self._bfcl = bfcl_agents
            self.agents = bfcl_agents.pick_agents(n_agents, turns, seed, roles or bfcl_agents.DEFAULT_ROLES)
            self.names = [a.agent for a in self.agents]
            mix = ", ".join(f"{n} x {r}" for r, n in sorted(Counter(a.role for a in self.agents).items()))
            self.what = (f"BFCL v4 multi_turn_base agents ({mix}), their first {turns} user turns, tools run on "
                         f"BFCL's classes, up to {max_steps} replies with calls a turn")
        else:
            self.wf = agent_runs.plan(seed, n_agents, turns)
            self.names = [c.agent for c in self.wf.conversations]
            self.what = f"generated agents of one role, {turns} turns each, scripted tool results"

    def budget(self, tokenizer, fraction: float, unit: int) -> dict:
        """The working set and a KV budget of `fraction` of it in whole units
        of `unit` tokens; ValueError where it cannot hold the longest request."""
        if self.kind == "bfcl":
            return self._bfcl.kv_budget(tokenizer, self.agents, self.max_tokens, fraction, unit)
        return agent_runs.kv_budget(tokenizer, self.wf, self.max_tokens, fraction, unit)

    def jobs(self, client: Client, on_request: OnTurn | None = None) -> dict[str, Job]:
        """Each agent's job against client, for agent_runs.run_all."""
        if self.kind == "bfcl":
            return {a.agent: partial(self._bfcl.run_bfcl_agent, a, client, self.max_tokens, self.max_steps,
                                     self.pauses, on_request) for a in self.agents}
        return {c.agent: partial(run_agent, c, client, self.max_tokens, self.pauses, on_request)
                for c in self.wf.conversations}
