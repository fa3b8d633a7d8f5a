"""Per-turn statistics (what a turn cost and what it reused) and the scheduler's counters."""
from __future__ import annotations

import bisect
import itertools
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentkv.cache.kv_tier import TierCounters


@dataclass(slots=True)
class TurnStats:
    prompt_tokens: int = 0  # tokens of the request (the whole rendered history for chat)
    reused_tokens: int = 0  # of those, whose KV was already held
    computed_tokens: int = 0  # tokens whose KV was computed by prefill this turn
    restored_tokens: int = 0  # of the reused, copied back from the second KV tier
    generated_tokens: int = 0
    queued_s: float = 0.0  # from submission to its first admission (program admission included)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    preemptions: int = 0
    decode_steps: int = 0
    drafted_tokens: int = 0  # speculation: draft tokens verified
    accepted_tokens: int = 0  # of those, accepted
    forced_tokens: int = 0  # of the drafted, what the grammar forced (jump-forward)
    forced_accepted: int = 0  # of those, accepted
    verify_steps: int = 0  # decode steps that verified a draft
    native_turns: int = 0  # 1 for a chat turn whose messages matched the session's log (engine.turn)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def accepted_per_step(self) -> float:
        """Draft tokens accepted per verify step (the bonus token not counted)."""
        return self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def forwards_saved(self) -> int:
        """Decode forwards that accepted drafts made unnecessary."""
        return self.accepted_tokens

    def as_dict(self) -> dict:
        return {**asdict(self), "total_s": self.total_s, "accepted_per_step": self.accepted_per_step,
                "forwards_saved": self.forwards_saved}


class Histogram:
    """Cumulative bucket counts, as Prometheus histograms read them."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.bounds):
            self.counts[i] += 1
        self.total += 1
        self.sum += value

    def cumulative(self) -> list[tuple[float, int]]:
        return list(zip(self.bounds, itertools.accumulate(self.counts)))


# Why a step left requests waiting, the first that applies naming the stall:
# a program's place, pinned KV due back, pages others hold, a prefix another
# request is computing, room to restore from the second tier.
STALLS = ("admission", "pinned", "pages", "prefix", "restore")


@dataclass
class SchedulerCounters:
    """What operators read off a server (vLLM's names in engine/api/metrics.py)."""

    steps: int = 0
    preemptions: int = 0
    repeat_preemptions: int = 0  # of a request preempted before (after it progressed, or lest a step stall)
    cancelled: int = 0
    failed: int = 0
    finished: int = 0
    prefix_queries: int = 0  # prompt tokens of admitted requests
    prefix_hits: int = 0  # of those, whose KV was held or found in the prefix cache
    prepositioned_tokens: int = 0  # computed ahead of a turn, while idle (pre-positioning)
    step_s: float = 0.0  # wall time of steps that ran a forward
    forward_s: float = 0.0  # of that, in the forward
    # Seconds the loop idled while requests waited, by STALLS: what the policy's waits cost.
    stalled_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STALLS, 0.0))
    batch_size: Histogram = field(default_factory=lambda: Histogram((1, 2, 4, 8, 16, 32, 64, 128, 256, 512)))
    queue_s: Histogram = field(default_factory=lambda: Histogram(
        (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)))


@dataclass(frozen=True)
class EngineMetrics:
    """One reading of the engine's gauges and counters, for a front end to
    export (Engine.metrics; engine/api/metrics.py names them)."""

    pages_total: int
    pages_free: int
    pages_used: int
    page_size: int  # tokens per page
    pages_pinned: int  # held by live sessions
    prefix_cache_pages: int  # held by the prefix cache alone
    in_flight: int  # requests queued or running
    running: int
    waiting: int
    counters: SchedulerCounters
    turn_totals: dict[str, float]
    programs: dict[str, int]  # admitted, queued, parked (engine.programs)
    admission_refusals: int  # requests a step left waiting for their program's place
    tier: "TierCounters | None"  # the second KV tier's, if there is one
    tier_host_bytes: int = 0
    tier_disk_bytes: int = 0
