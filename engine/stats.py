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
    verify_steps: int = 0  # decode steps that verified a draft

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
