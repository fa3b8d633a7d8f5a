"""The serving limits: how much work a step takes, how much may wait, and
how many sessions and turn records are kept. Defaults are what vLLM's and
SGLang's users expect of a single server; serve.py exposes each as a flag."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int = 256  # requests in one step
    max_num_batched_tokens: int = 2048  # tokens one step computes: prefill chunks, decode and draft tokens
    # A prompt is computed in chunks that end at multiples of this (capped
    # by the step's budget) and at the prompt's end, whatever else shares
    # the step, so that its logits do not depend on batch composition. A
    # chunk waits for a step with room for all of it.
    prefill_chunk: int = 512
    max_queue: int = 1024  # waiting requests; past it a submission is refused (429)
    # Live sessions (a server's named sessions and their forks), not a turn's
    # working sequence nor a stored response's: at it a new one is refused
    # (TooManySessionsError, a 429) and none is closed to make room.
    max_sessions: int = 4096
    session_idle_timeout: float | None = None  # seconds; idle sessions past it are closed
    # The longest pin a client may ask for (POST /v1/sessions/{id}/retain, and
    # what one without seconds gets): a pin never outlives it, so no client's
    # KV is held in the pool for good.
    max_retain_s: float = 600.0
    max_stats: int = 10_000  # per-turn records kept in Engine.stats

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk", "max_queue", "max_sessions", "max_stats"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.prefill_chunk > self.max_num_batched_tokens:
            raise ValueError(f"prefill_chunk {self.prefill_chunk} exceeds max_num_batched_tokens {self.max_num_batched_tokens}")
        timeout = self.session_idle_timeout
        if timeout is not None and not timeout > 0:
            raise ValueError(f"session_idle_timeout must be > 0 or None, got {timeout!r}")
        if not (isinstance(self.max_retain_s, (int, float)) and 0 < self.max_retain_s < float("inf")):
            raise ValueError(f"max_retain_s must be a finite number of seconds > 0, got {self.max_retain_s!r}")
