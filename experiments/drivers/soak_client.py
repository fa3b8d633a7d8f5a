"""The soak's well-behaved agent client (experiments/soak.py): each turn a
streamed chat request in the agent's named session, greedy, sent again
after a fault cut it off, a bounded number of times within a deadline.

Around every turn it reads the session (GET /v1/sessions/{id}) and holds
the server to its contract:
- at the turn's start the session records exactly the turns this client saw
  completed (fewer: a completed turn was lost; more: a turn was written
  that nobody saw finish, beyond the cut-offs accounted for below);
- after a cut-off (the client hung up mid-reply, or the server was killed
  under it) the session is either as before the request (the turn is
  absent) or one turn further (it completed before the cut): never between.
A turn written but never seen is re-sent all the same (the client cannot
read its reply back), so the session then records it twice.

Watch says what each agent's request is doing at this moment (sent and
waiting for its first token: prefill; streaming: decode), for the soak's
injector to kill the server at those points.
"""
from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import httpx

from agentkv.experiments.workloads.agent_runs import Reply


class TurnGaveUp(RuntimeError):
    """A turn's tries or deadline ran out."""


class Refused(RuntimeError):
    """The server answered a well-formed turn with an error that is not a fault's (4xx other than 409/429)."""


@dataclass(frozen=True)
class RetryPolicy:
    tries: int  # requests per turn, the first included
    deadline_s: float  # from the turn's first request


@dataclass
class InFlight:
    agent: str
    turn: int
    sent: float  # time.monotonic()
    first_token: float | None = None  # when the stream's first chunk came (the prompt is computed)
    deltas: int = 0  # content chunks since


class Watch:
    """The agents' requests in flight, for timing kills."""

    def __init__(self):
        self._now: dict[str, InFlight] = {}
        self._cond = threading.Condition()

    def begin(self, agent: str, turn: int) -> None:
        with self._cond:
            self._now[agent] = InFlight(agent, turn, time.monotonic())
            self._cond.notify_all()

    def first_token(self, agent: str) -> None:
        with self._cond:
            self._now[agent].first_token = time.monotonic()
            self._cond.notify_all()

    def delta(self, agent: str) -> None:
        with self._cond:
            self._now[agent].deltas += 1
            self._cond.notify_all()

    def end(self, agent: str) -> None:
        with self._cond:
            self._now.pop(agent, None)
            self._cond.notify_all()

    def current(self, agent: str) -> InFlight | None:
        """The agent's request in flight now (a copy), if any."""
        with self._cond:
            f = self._now.get(agent)
            return InFlight(**vars(f)) if f is not None else None

    def wait_for(self, pick: Callable[[list[InFlight]], InFlight | None], timeout: float) -> InFlight | None:
        """The first request pick() chooses among those in flight (a copy), within timeout; None if none."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                chosen = pick([InFlight(**vars(f)) for f in self._now.values()])
                left = deadline - time.monotonic()
                if chosen is not None or left <= 0:
                    return chosen
                self._cond.wait(min(left, 0.01))  # pick() may wait on time alone


@dataclass
class Tally:
    """What the agents' client met, all agents together."""

    statuses: dict[str, Counter] = field(default_factory=dict)  # tenant -> status -> count
    retries: int = 0  # requests re-sent after a cut-off, a 5xx, a 409 or a 429
    cut_off: Counter = field(default_factory=Counter)  # "killed" / "dropped" -> count
    absent: int = 0  # cut-off turns the session does not hold
    complete: int = 0  # cut-off turns the session holds whole (written before the cut)
    half_written: list[str] = field(default_factory=list)  # cut-off turns the session holds neither way
    turns_missing: list[str] = field(default_factory=list)  # turns seen completed that the session no longer records
    turns_extra: list[str] = field(default_factory=list)  # turns the session records that nobody saw
    sessions_lost: list[str] = field(default_factory=list)  # sessions gone that held a completed turn
    gave_up: list[str] = field(default_factory=list)
    stream_errors: list[str] = field(default_factory=list)  # error events after the first token
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, tenant: str, status: int) -> None:
        with self.lock:
            self.statuses.setdefault(tenant, Counter())[status] += 1

    def add(self, name: str, item: object = 1) -> None:
        with self.lock:
            value = getattr(self, name)
            if isinstance(value, list):
                value.append(item)
            elif isinstance(value, Counter):
                value[item] += 1
            else:
                setattr(self, name, value + item)

    def as_json(self) -> dict:
        with self.lock:
            return {"statuses": {t: dict(c) for t, c in self.statuses.items()}, "retries": self.retries,
                    "cut_off": dict(self.cut_off), "absent": self.absent, "complete": self.complete,
                    "half_written": list(self.half_written), "turns_missing": list(self.turns_missing),
                    "turns_extra": list(self.turns_extra), "sessions_lost": list(self.sessions_lost),
                    "gave_up": list(self.gave_up), "stream_errors": list(self.stream_errors)}


class _Cut(Exception):
    """This try ended without a reply: the client hung up, or the connection died."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


class AgentClient:
    """A Client (experiments.workloads.agent_runs) for the soak's agents.

    url(): the server's address now; wait_up(deadline): block until it
    answers /health (it may be restarting), or TimeoutError at deadline
    (time.monotonic()); key(tenant): its API key; drops: (agent, turn)
    pairs whose first try to stream the client hangs up mid-reply."""

    def __init__(self, url: Callable[[], str], wait_up: Callable[[float], None], tenants: dict[str, str],
                 key: Callable[[str], str], model: str, policy: RetryPolicy, watch: Watch, tally: Tally,
                 drops: set[tuple[str, int]] = frozenset()):
        self.url, self.wait_up, self.tenants, self.key, self.model = url, wait_up, tenants, key, model
        self.policy, self.watch, self.tally, self.drops = policy, watch, tally, drops
        self._seen: Counter = Counter()  # agent -> turns the session should record

    def __call__(self, agent: str, messages: list[dict], tools: list[dict], max_tokens: int) -> Reply:
        turn = sum(m["role"] == "assistant" for m in messages)
        name = f"{agent}#{turn}"
        deadline = time.monotonic() + self.policy.deadline_s
        body = {"model": self.model, "messages": messages, "tools": tools, "max_tokens": max_tokens,
                "temperature": 0.0, "session_id": agent, "stream": True, "stream_options": {"include_usage": True}}
        dropped = (agent, turn) not in self.drops  # its first try that streams is hung up
        for attempt in range(self.policy.tries):
            if attempt:
                self.tally.add("retries")
            if time.monotonic() > deadline:
                break
            try:
                before = self._check_start(agent, name, deadline)
                try:
                    reply = self._stream(agent, turn, body, drop=not dropped)
                except _Cut as cut:
                    dropped = dropped or cut.kind == "dropped"
                    self.tally.add("cut_off", cut.kind)
                    self._check_cut(agent, name, before, deadline)
                    continue
            except _Retry:
                time.sleep(0.2)
                continue
            except TimeoutError:  # the server did not come back by the turn's deadline
                break
            self._seen[agent] += 1
            return reply
        self.tally.add("gave_up", name)
        raise TurnGaveUp(f"{name}: no reply after {self.policy.tries} tries or {self.policy.deadline_s:.0f} s")

    def settle(self, agent: str) -> None:
        """After the run: hold the agent's session to the turns it saw completed."""
        self._check_start(agent, f"{agent}#end", time.monotonic() + self.policy.deadline_s)

    def _headers(self, agent: str) -> dict:
        return {"Authorization": f"Bearer {self.key(self.tenants[agent])}"}

    def _session(self, agent: str, deadline: float) -> dict | None:
        """The agent's session once no request is in flight on it (a cut-off
        one is reaped within a step); None if the server has none."""
        while True:
            try:
                r = httpx.get(f"{self.url()}/v1/sessions/{agent}", headers=self._headers(agent), timeout=60)
            except httpx.TransportError:
                self.wait_up(deadline)
                continue
            if r.status_code == 404:
                return None
            self._status(agent, r)
            info = r.json()
            if not info["busy"] or time.monotonic() > deadline:
                return info
            time.sleep(0.05)

    def _check_start(self, agent: str, name: str, deadline: float) -> tuple[int, int]:
        """Hold the session to the turns this client saw; (tokens, turns) before the request."""
        info = self._session(agent, deadline)
        seen = self._seen[agent]
        if info is None:
            if seen:
                self.tally.add("sessions_lost", name)
                self._seen[agent] = 0
            return 0, 0
        held = len(info["turns"])
        if held < seen:
            self.tally.add("turns_missing", f"{name}: {held} of {seen}")
        elif held > seen:
            self.tally.add("turns_extra", f"{name}: {held} of {seen}")
        self._seen[agent] = held  # judge what comes next against what is there now
        return info["length"], held

    def _check_cut(self, agent: str, name: str, before: tuple[int, int], deadline: float) -> None:
        info = self._session(agent, deadline)
        after = (0, 0) if info is None else (info["length"], len(info["turns"]))
        if after == before:
            self.tally.add("absent")
        elif after[1] == before[1] + 1:
            self.tally.add("complete")
            self._seen[agent] += 1  # written before the cut: the retry is one more
        else:
            self.tally.add("half_written", f"{name}: (tokens, turns) {before} -> {after}")
            self._seen[agent] = after[1]

    def _status(self, agent: str, r: httpx.Response) -> None:
        self.tally.count(self.tenants[agent], r.status_code)
        if r.status_code >= 500 or r.status_code in (409, 429):
            raise _Retry()
        if r.status_code >= 400:
            raise Refused(f"{r.status_code}: {r.text[:300]}")

    def _stream(self, agent: str, turn: int, body: dict, drop: bool) -> Reply:
        self.watch.begin(agent, turn)
        try:
            with httpx.stream("POST", self.url() + "/v1/chat/completions", json=body, headers=self._headers(agent),
                              timeout=httpx.Timeout(900.0, connect=10.0)) as r:
                if r.status_code != 200:
                    r.read()
                    self._status(agent, r)
                self.tally.count(self.tenants[agent], 200)
                return self._read(agent, r, drop)
        except httpx.TransportError as e:
            raise _Cut("killed") from e
        finally:
            self.watch.end(agent)

    def _read(self, agent: str, r: httpx.Response, drop: bool) -> Reply:
        text, calls, finish, usage, first = [], [], None, None, True
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                self.tally.add("stream_errors", f"{agent}: {chunk['error'].get('message')}")
                raise _Retry()
            if first:
                self.watch.first_token(agent)
                first = False
                if drop:  # hang up mid-reply: its first tokens are out, the rest not
                    raise _Cut("dropped")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    text.append(delta["content"])
                    self.watch.delta(agent)
                calls += [{"id": c["id"], "name": c["function"]["name"],
                           "arguments": json.loads(c["function"]["arguments"])} for c in delta.get("tool_calls") or ()]
                finish = choice.get("finish_reason") or finish
        if finish is None or usage is None:
            raise _Cut("killed")  # the stream ended early: the server went away
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Reply("".join(text) or None, calls, usage["prompt_tokens"], cached, finish, usage["completion_tokens"])


class _Retry(Exception):
    """A 5xx, 409 (the session still reaping a cut-off request) or 429: send again."""
