"""Per-turn statistics: what a turn cost and what it reused."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class TurnStats:
    prompt_tokens: int = 0  # tokens of the request (the whole rendered history for chat)
    reused_tokens: int = 0  # of those, whose KV was already held
    computed_tokens: int = 0  # tokens whose KV was computed by prefill this turn
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    drafted_tokens: int = 0  # speculation: draft tokens verified
    accepted_tokens: int = 0  # of those, accepted

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    def as_dict(self) -> dict:
        return {**asdict(self), "total_s": self.total_s}
