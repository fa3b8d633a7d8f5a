"""A persistent conversation: its tokens and the pages holding their KV.

A session's KV lives across turns; a turn is "append Δ tokens, then decode".
The last token a generate() draws is held but not yet computed (its KV would
only be needed by the next append), so it rides along with the next append's
delta instead of costing a forward of its own.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from cache.block_table import BlockTable
from engine.errors import ContextLengthError, InvalidRequestError, SessionBusyError, SessionClosedError
from engine.runner import StepItem
from engine.stats import TurnStats
from model.sampler import SamplingParams, make_generator, sample

if TYPE_CHECKING:
    from engine.engine import Engine


class Session:
    def __init__(self, engine: "Engine", namespace: str = "default", table: BlockTable | None = None, tokens: Iterable[int] = ()):
        self.engine = engine
        self.namespace = namespace
        self.table = table if table is not None else BlockTable(engine.pool)
        self._tokens: list[int] = list(tokens)
        self._last_logits: torch.Tensor | None = None  # valid while every token's KV is held
        self._lock = threading.Lock()
        self._closed = False
        self.turn = TurnStats()

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def closed(self) -> bool:
        return self._closed

    @contextmanager
    def _busy(self) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise SessionBusyError("the session already has a request in flight")
        try:
            if self._closed:
                raise SessionClosedError("the session is closed")
            yield
        finally:
            self._lock.release()

    def _check_tokens(self, token_ids: Iterable[int]) -> list[int]:
        ids = list(token_ids)
        if not ids:
            raise InvalidRequestError("append needs at least one token")
        vocab = self.engine.model.cfg.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} is not in [0, {vocab})")
        self._check_length(len(self._tokens) + len(ids))
        return ids

    def _check_length(self, n: int) -> None:
        limit = self.engine.max_context
        if n > limit:
            raise ContextLengthError(f"{n} tokens exceed the model's context of {limit}")

    def _compute(self, new: list[int], num_logits: int = 1) -> torch.Tensor:
        """Compute the KV of held-but-pending tokens plus `new`; on success the
        tokens are held. Returns the logits of the last num_logits tokens."""
        chunk = self._tokens[self.table.length :] + new
        logits = self.engine.runner.step([StepItem(self.table, chunk, min(num_logits, len(chunk)))])[0]
        self._tokens.extend(new)
        self._last_logits = logits[-1]
        return logits

    def append(self, token_ids: Iterable[int], *, all_logits: bool = False) -> torch.Tensor:
        """Compute the KV of these tokens (and nothing held before them).
        Returns the logits after the last token [vocab], or with all_logits
        the logits after each appended token [n, vocab]."""
        with self._busy():
            ids = self._check_tokens(token_ids)
            start = time.perf_counter()
            pending = len(self._tokens) - self.table.length
            logits = self._compute(ids, len(ids) if all_logits else 1)
            self.turn.computed_tokens += len(ids) + pending
            self.turn.prefill_s += time.perf_counter() - start
            return logits[-len(ids) :] if all_logits else logits[-1]

    def _next_logits(self) -> torch.Tensor:
        if self._last_logits is not None and self.table.length == len(self._tokens):
            return self._last_logits
        if not self._tokens:
            raise InvalidRequestError("generate needs a non-empty session: append a prompt first")
        if self.table.length == len(self._tokens):
            # Logits are not kept across truncate/fork: recompute the last token.
            self.table.truncate(len(self._tokens) - 1)
        self.turn.computed_tokens += len(self._tokens) - self.table.length
        return self._compute([])[-1]

    def generate(
        self,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: str | Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
    ) -> list[int]:
        """Decode up to max_tokens new tokens; they stay in the session. Stops
        after EOS (unless ignore_eos), a stop token id, or once the text ends
        with a stop string (the completing token is kept). On error the
        session is as it was before the call."""
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, max_tokens=max_tokens,
            stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
        )
        if params.stop and self.engine.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none")
        with self._busy():
            self._check_length(len(self._tokens) + 1)
            before = len(self._tokens)
            try:
                out = self._decode(params)
            except BaseException:
                self._rollback(before)
                raise
            self.engine.finish_turn(self)
            return out

    def _decode(self, params: SamplingParams) -> list[int]:
        start = time.perf_counter()
        logits = self._next_logits()
        self.turn.prefill_s += time.perf_counter() - start
        start = time.perf_counter()
        generator = None if params.greedy else make_generator(params.seed)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.engine.eos_token_ids)
        out: list[int] = []
        while True:
            token = int(sample(logits[None], params, [generator] if generator else None)[0])
            out.append(token)
            self._tokens.append(token)
            self._last_logits = None
            if (
                token in stop_ids
                or len(out) >= params.max_tokens
                or len(self._tokens) >= self.engine.max_context
                or (params.stop and self._ends_with_stop(out, params.stop))
            ):
                break
            logits = self._compute([])[-1]
            self.turn.decode_steps += 1
        self.turn.generated_tokens += len(out)
        self.turn.decode_s += time.perf_counter() - start
        return out

    def _ends_with_stop(self, out: list[int], stops: tuple[str, ...]) -> bool:
        # Only the tail can newly contain a stop string: decode a window long
        # enough for the longest one.
        tail = self.engine.tokenizer.decode(out[-(max(map(len, stops)) + 8) :])
        return any(s in tail for s in stops)

    def _rollback(self, n: int) -> None:
        del self._tokens[n:]
        self.table.truncate(min(n, self.table.length))
        self._last_logits = None

    def truncate(self, n: int) -> None:
        """Keep the first n tokens; pages wholly past them are released."""
        with self._busy():
            if not isinstance(n, int) or not 0 <= n <= len(self._tokens):
                raise InvalidRequestError(f"cannot truncate a session of {len(self._tokens)} tokens to {n!r}")
            if n < len(self._tokens):
                self._rollback(n)

    def fork(self) -> "Session":
        """A new session sharing every page (copy-on-write on the first write
        into a shared partially filled page, by either side)."""
        with self._busy():
            return Session(self.engine, self.namespace, self.table.fork(), self._tokens)

    def adopt(self, other: "Session") -> None:
        """Take over other's tokens and pages (other is closed), releasing ours."""
        with self._busy():
            self.table.release()
            self.table, other.table = other.table, BlockTable(self.engine.pool)
            self._tokens, other._tokens = other._tokens, []
            self._last_logits = other._last_logits
            self.turn = other.turn
            other.close()

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self.table.release()
            self._tokens.clear()
            self._last_logits = None
            self._closed = True

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
