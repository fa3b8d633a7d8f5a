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
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch

from cache.block_table import BlockTable
from engine.errors import ContextLengthError, InvalidRequestError, SessionBusyError, SessionClosedError
from engine.grammar import Grammar, GrammarState
from engine.runner import StepItem
from engine.stats import TurnStats
from engine.scheduler import Request
from model.sampler import SamplingParams
from profiling.nvtx import nvtx_range
from spec.ngram import NGramDrafter

if TYPE_CHECKING:
    from engine.engine import Engine


class Session:
    def __init__(
        self,
        engine: "Engine",
        namespace: str = "default",
        table: BlockTable | None = None,
        tokens: Iterable[int] = (),
        pin_ttl: float | None = None,
    ):
        self.engine = engine
        self.namespace = namespace
        # Seconds an idle session keeps its pages pinned; after that, under
        # memory pressure, they may be released (parked) and later re-matched
        # from the prefix cache. None pins for the session's whole life.
        self.pin_ttl = pin_ttl
        self.idle_since = time.monotonic()
        self._parked = False
        self.table = table if table is not None else BlockTable(engine.pool)
        self._tokens: list[int] = list(tokens)
        self._last_logits: torch.Tensor | None = None  # valid while every token's KV is held
        self._drafter: NGramDrafter | None = None
        self.finish_reason: str | None = None  # of the last generate: "stop" or "length"
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
    def _busy(self, hold_engine: bool = True) -> Iterator[None]:
        """One call at a time per session; with hold_engine, also exclusive
        use of the engine's pages and model for the call's duration."""
        if not self._lock.acquire(blocking=False):
            raise SessionBusyError("the session already has a request in flight")
        try:
            if self._closed:
                raise SessionClosedError("the session is closed")
            if hold_engine:
                with self.engine.lock:
                    self.ensure_resident()
                    yield
            else:
                yield
        finally:
            self.idle_since = time.monotonic()
            self._lock.release()

    def ensure_resident(self) -> None:
        """Bring a parked session's KV back: the cached prefix of its tokens
        from the prefix cache; the rest is recomputed by its next step.
        Called with the engine lock held."""
        if self._parked:
            self._parked = False
            self.table = BlockTable(self.engine.pool)
            self._reuse_prefix(self._tokens, len(self._tokens))

    def _reuse_prefix(self, tokens: list[int], limit: int) -> None:
        """A session holding no KV starts from the longest cached prefix of
        tokens (at most limit tokens of it)."""
        radix = self.engine.radix
        if radix is None or self.table.length or not tokens or limit < 1:
            return
        length, pages = radix.match(tokens, self.namespace)
        length = min(length, limit)
        ps = self.engine.pool.page_size
        if self.engine.prefix_match == "block":
            length -= length % ps
        keep = -(-length // ps)
        self.engine.pool.decref(pages[keep:])
        self.table.release()
        self.table = BlockTable(self.engine.pool, pages[:keep], length)

    def publish(self) -> None:
        """Offer this session's computed tokens to the prefix cache, so that
        other sessions (and this one, once parked) can start from them."""
        radix, n = self.engine.radix, self.table.length
        if radix is not None and n:
            radix.insert(self._tokens[:n], self.table.pages[: -(-n // self.engine.pool.page_size)], self.namespace)

    def expired(self, now: float) -> bool:
        """Idle past its pin time-to-live, with pages that could be released."""
        return (
            self.pin_ttl is not None
            and not self._closed
            and not self._lock.locked()
            and now - self.idle_since >= self.pin_ttl
            and bool(self.table.pages)
        )

    def park(self) -> None:
        """Publish and release this idle session's pages; its tokens stay, and
        its next call re-matches them from the prefix cache."""
        self.publish()
        self.table.release()
        self._last_logits = None
        self._parked = True

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
        held = self.table.length
        # The KV held may reach into `new` (a prefix-cache match), or stop
        # short of the tokens already held (pending ones).
        chunk = self._tokens[held:] + new if held <= len(self._tokens) else new[held - len(self._tokens) :]
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
            # Logits are wanted for the last new token, or with all_logits
            # for every one: a cached prefix is reused no further than that.
            self._reuse_prefix(self._tokens + ids, len(self._tokens) + (0 if all_logits else len(ids) - 1))
            if not self.turn.computed_tokens:
                self.turn.reused_tokens = self.table.length
            computed = len(self._tokens) + len(ids) - self.table.length
            with nvtx_range("prefill"):
                logits = self._compute(ids, len(ids) if all_logits else 1)
            self.turn.computed_tokens += computed
            self.turn.prefill_s += time.perf_counter() - start
            return logits[-len(ids) :] if all_logits else logits[-1]

    def queue(self, token_ids: Iterable[int]) -> None:
        """Hold these tokens without computing them yet: the next generate
        computes them in its first step (chunked, batched with other work)
        and draws the first token from their last logits."""
        with self._busy():
            ids = self._check_tokens(token_ids)
            self._reuse_prefix(self._tokens + ids, len(self._tokens) + len(ids) - 1)
            self._tokens.extend(ids)
            self._last_logits = None

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
        speculative: bool = True,
        on_tokens: Callable[[list[int]], None] | None = None,
        grammar: Grammar | None = None,
    ) -> list[int]:
        """Decode up to max_tokens new tokens; they stay in the session. Stops
        after EOS (unless ignore_eos), a stop token id, or once the text ends
        with a stop string (the completing token is kept). With speculative,
        prompt-lookup drafts from the session's history are verified k+1
        tokens per forward (greedy output is identical; sampling keeps the
        model's distribution). on_tokens, if given, is called with each step's
        new tokens (streaming). With a grammar (engine.structured.request_grammar),
        every token drawn and every draft accepted is one the grammar allows,
        and generation stops where the grammar ends. On error the session is
        as it was before."""
        try:
            params = SamplingParams(
                temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, max_tokens=max_tokens,
                stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
            )
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        if params.stop and self.engine.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none")
        if grammar is not None and grammar.vocab_size != self.engine.model.cfg.vocab_size:
            raise InvalidRequestError("the grammar was compiled for another vocabulary")
        # The scheduler takes the engine lock step by step, so that other
        # sessions' requests batch with this one meanwhile.
        with self._busy(hold_engine=False):
            if not self._tokens:
                raise InvalidRequestError("generate needs a non-empty session: append a prompt first")
            self._check_length(len(self._tokens) + 1)
            req = Request(self, params, speculative, on_tokens, GrammarState(grammar) if grammar is not None else None)
            out = self.engine.scheduler.run(req)
            self.finish_reason = req.finish_reason
            with self.engine.lock:
                self.publish()
            self.engine.finish_turn(self)
            return out

    def drafter(self) -> NGramDrafter:
        """The prompt-lookup drafter over this session's tokens, brought up to date."""
        if self._drafter is None:
            self._drafter = NGramDrafter()
        self._drafter.extend(self._tokens[len(self._drafter) :])
        return self._drafter

    def ends_with_stop(self, out: list[int], stops: tuple[str, ...]) -> bool:
        # Only the tail can newly contain a stop string: decode a window long
        # enough for the longest one.
        tail = self.engine.tokenizer.decode(out[-(max(map(len, stops)) + 8) :])
        return any(s in tail for s in stops)

    def _invalidate_logits(self) -> None:
        self._last_logits = None

    def _rollback(self, n: int) -> None:
        del self._tokens[n:]
        self.table.truncate(min(n, self.table.length))
        self._last_logits = None
        if self._drafter is not None and len(self._drafter) > n:
            self._drafter.truncate(n)

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
            return self.engine.session(self.namespace, self.pin_ttl, self.table.fork(), self._tokens)

    def fork_for_turn(self) -> "Session":
        """A fork that also takes over this session's draft index (kept in step
        lazily: whichever side ends up with it re-syncs from its tokens), so a
        turn worked on a fork need not rebuild it. See Engine.chat."""
        child = self.fork()
        child._drafter, self._drafter = self._drafter, None
        return child

    def adopt(self, other: "Session") -> None:
        """Take over other's tokens and pages (other is closed), releasing ours."""
        with self._busy():
            self.table.release()
            self.table, other.table = other.table, BlockTable(self.engine.pool)
            self._tokens, other._tokens = other._tokens, []
            self._drafter, other._drafter = other._drafter, None
            self._last_logits = other._last_logits
            self.finish_reason = other.finish_reason
            self.turn = other.turn
            other.close()

    def close(self) -> None:
        if self._closed:
            return
        with self._lock, self.engine.lock:
            self.publish()
            self.table.release()
            self._tokens.clear()
            self._last_logits = None
            self._closed = True

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
