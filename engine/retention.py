"""How long an idle session keeps its KV in the pool, and who gives way first.

A session whose turn ended on tool calls is awaiting those tools: its pages
stay pinned for as long as the tools usually take (Continuum's tool-aware
TTL): a moving estimate per tool name of the pauses observed, from the turn
that called the tool ending to the session's next turn arriving, times a
margin, within a floor and a cap. A client that says how long its pause
will be (X-Tool-Expected-Seconds) is believed, within the cap. Past the pin the session is offloadable.
A session whose turn ended with a final answer is retained at lower
priority: pinned, the same way, for the pause its tenant's sessions take
after a final answer before their next turn (agents' next user turn often
follows at once; a chat user's takes minutes, past the cap), final_ttl
until one is observed; among the offloadable, the first to go. Pins follow
what the server sees, not what it parses: a reply it cannot read as calls
(cut short, a format it does not know) is a final answer whose pause is
still learned.

Order under memory pressure (engine.kv_policy, engine.batch_planner):
unused cached prefixes (LRU); offloadable sessions, final answers before
sessions awaiting a tool, then longest idle, then the smallest reuse value
(fewest tokens held); then the pinned ones (soft pins), the least valuable
first: what bringing a session's KV back would cost, per second until it is
expected back (its tool's estimated pause); only then is running work
preempted: idle KV never outranks work in flight.

"lru" is the ablation: no pins and no tool awareness; idle sessions give
way by idle time alone.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

from agentkv.engine.errors import InvalidRequestError
from agentkv.engine.sequence import Sequence, owner_of

MODES = ("tool", "lru")
# Tool names are the client's: past this many per tenant, the least recently
# observed is forgotten (it pins for tool_ttl_default again), so no tenant can
# grow the table without bound.
MAX_TOOLS_PER_OWNER = 256


@dataclass(frozen=True)
class RetentionConfig:
    mode: str = "tool"
    tool_ttl_default: float = 10.0  # seconds, for a tool never observed
    tool_ttl_floor: float = 1.0
    tool_ttl_cap: float = 300.0
    margin: float = 1.5  # pin for this many times the estimated pause
    final_ttl: float = 0.0  # a session whose turn ended with a final answer
    smoothing: float = 0.3  # weight of a new observation in the moving estimate

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"retention mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if not 0 <= self.tool_ttl_floor <= self.tool_ttl_cap:
            raise ValueError("need 0 <= tool_ttl_floor <= tool_ttl_cap")
        for name in ("tool_ttl_default", "margin", "final_ttl"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        if not 0 < self.smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")


def check_pause(seconds: float | None) -> None:
    """A client's expected pause is a finite number of seconds >= 0 (or None)."""
    if seconds is not None and not 0 <= seconds < math.inf:
        raise InvalidRequestError(f"the expected pause must be >= 0 seconds, got {seconds!r}")


class Retention:
    def __init__(self, config: RetentionConfig | None = None):
        self.config = config or RetentionConfig()
        # owner -> tool name -> [moving estimate of its pause, observations],
        # least recently observed first: each tenant's tools are its own, so
        # no tenant's pauses set another's pins.
        self._tools: dict[str, OrderedDict[str, list]] = {}
        # owner -> [moving estimate of the pause after a final answer, observations]
        self._answers: dict[str, list] = {}
        self._lock = threading.Lock()

    @property
    def lru(self) -> bool:
        return self.config.mode == "lru"

    def _clamp(self, seconds: float) -> float:
        c = self.config
        return min(max(seconds, c.tool_ttl_floor), c.tool_ttl_cap)

    def tool_ttl(self, owner: str, tools: tuple[str, ...]) -> float:
        """The pin for owner's session awaiting these tools (run together: the longest)."""
        c = self.config
        with self._lock:
            known = self._tools.get(owner, {})
            pauses = [known[t][0] if t in known else c.tool_ttl_default for t in tools]
        return self._clamp(max(pauses, default=c.tool_ttl_default) * c.margin)

    def end_turn(self, seq: Sequence, tools: list[str], expected_s: float | None = None) -> None:
        """A turn on seq ended: awaiting these tools, or (none) a final answer;
        expected_s: the client's word for the pause before its next turn."""
        seq.awaiting = tuple(tools) or None
        seq.answered = not tools and not self.lru
        if self.lru:
            seq.pin_ttl = 0.0
        elif expected_s is not None:
            seq.pin_ttl = self._clamp(expected_s * self.config.margin)
        elif not tools:
            with self._lock:
                known = self._answers.get(owner_of(seq.namespace))
            seq.pin_ttl = self.config.final_ttl if known is None else self._clamp(known[0] * self.config.margin)
        else:
            seq.pin_ttl = self.tool_ttl(owner_of(seq.namespace), seq.awaiting)

    def resumed(self, seq: Sequence, now: float) -> None:
        """seq's next request arrived: the pause is an observation of its tools."""
        tools, answered, seq.awaiting, seq.answered = seq.awaiting, seq.answered, None, False
        if not (tools or answered) or self.lru:
            return
        pause = min(now - seq.idle_since, self.config.tool_ttl_cap)
        a = self.config.smoothing
        owner = owner_of(seq.namespace)
        with self._lock:
            if not tools:
                old = self._answers.get(owner)
                self._answers[owner] = [pause, 1] if old is None else [(1 - a) * old[0] + a * pause, old[1] + 1]
                return
            known = self._tools.setdefault(owner, OrderedDict())
            for t in tools:
                old = known.pop(t, None)
                known[t] = [pause, 1] if old is None else [(1 - a) * old[0] + a * pause, old[1] + 1]
            while len(known) > MAX_TOOLS_PER_OWNER:
                known.popitem(last=False)

    def eviction_key(self, seq: Sequence) -> tuple:
        """Sort key of offloadable sessions: the first gives way first."""
        if self.lru:
            return (seq.idle_since,)
        return (seq.awaiting is not None, seq.idle_since, seq.table.length)

    def expected_back(self, seq: Sequence) -> float:
        """When (time.monotonic) a pinned idle session's next turn is expected:
        after its tool's estimated pause (the pin less its margin), else at
        its pin's end."""
        if seq.pin_ttl is None:
            return math.inf
        paused = seq.awaiting or seq.answered
        pause = seq.pin_ttl / self.config.margin if paused and self.config.margin > 0 else seq.pin_ttl
        return seq.idle_since + pause

    def due_in(self, seq: Sequence, now: float) -> float:
        """Seconds until a pinned idle session's next turn is expected: what
        is left of its estimated pause; once past it, as long again as it
        has been paused (pauses are heavy-tailed: one that ran long is from
        the tail, and likely to run longer)."""
        left = self.expected_back(seq) - now
        return left if left >= 0 else now - seq.idle_since

    def estimates(self, owner: str = "default") -> dict[str, dict]:
        """Per tool of owner's: the pause estimate (seconds), the pin it gives, observations."""
        with self._lock:
            items = [(t, p, n) for t, (p, n) in self._tools.get(owner, {}).items()]
        return {t: {"pause_s": p, "pin_s": self.tool_ttl(owner, (t,)), "observed": n} for t, p, n in items}

    def answer_estimate(self, owner: str = "default") -> dict | None:
        """owner's pause after a final answer, as estimates gives a tool's; None until observed."""
        with self._lock:
            known = self._answers.get(owner)
        if known is None:
            return None
        return {"pause_s": known[0], "pin_s": self._clamp(known[0] * self.config.margin), "observed": known[1]}
