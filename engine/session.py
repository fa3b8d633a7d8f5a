"""A persistent conversation: a handle on one of the scheduler's sequences.

Every call submits to the scheduler: append and generate are requests that
run in its steps (batched with everyone else's), truncate, fork and close
are operations on the sequence under its lock. Without a background loop
the call drives the steps itself. A failed call leaves the session exactly
as before (tokens, pages, length).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from agentkv.cache.block_table import BlockTable
from agentkv.cache.kv_tier import KVTier
from agentkv.engine.errors import ContextLengthError, InvalidRequestError
from agentkv.engine.grammar import Grammar, GrammarState
from agentkv.engine.message_log import MessageLog
from agentkv.engine.request import OnDone, OnTokens, Request
from agentkv.engine.retention import check_pause
from agentkv.engine.scheduler import Scheduler
from agentkv.engine.sequence import Sequence
from agentkv.engine.sequences import Sequences
from agentkv.engine.stats import TurnStats
from agentkv.model.sampler import SamplingParams
from agentkv.spec.drafter import Drafter


@dataclass(frozen=True)
class SessionContext:
    """What a session needs of its engine, and no more."""

    scheduler: Scheduler
    sequences: Sequences
    tier: KVTier | None  # the second KV tier, where saved sessions go
    vocab_size: int
    max_context: int
    has_tokenizer: bool  # stop strings need one


class Session:
    def __init__(self, context: SessionContext, seq: Sequence):
        self._context = context
        self._scheduler, self._sequences = context.scheduler, context.sequences
        self._seq = seq
        self._sequences.close_on_collect(self, seq)
        # Which chat messages the tokens are (engine.turn sets it); any
        # other change to the tokens forgets it.
        self.message_log: MessageLog | None = None

    @property
    def tokens(self) -> list[int]:
        return list(self._seq.tokens)

    def __len__(self) -> int:
        return len(self._seq)

    @property
    def namespace(self) -> str:
        return self._seq.namespace

    @property
    def table(self) -> BlockTable:
        """The pages holding this session's KV (read-only use)."""
        return self._seq.table

    @property
    def turn(self) -> TurnStats:
        """The current turn's record (filed in Engine.stats when a generation ends)."""
        return self._seq.turn

    @property
    def finish_reason(self) -> str | None:
        """Of the last generation: "stop" or "length"."""
        return self._seq.finish_reason

    @property
    def closed(self) -> bool:
        return self._seq.closed

    @property
    def busy(self) -> bool:
        return self._seq.busy

    @property
    def pin_ttl(self) -> float | None:
        """Seconds this session's pages stay pinned while idle (None: always)."""
        return self._seq.pin_ttl

    @pin_ttl.setter
    def pin_ttl(self, seconds: float | None) -> None:
        self._seq.pin_ttl = seconds

    @property
    def key(self) -> str:
        """Names this session's KV in the second tier (shared by the forks that work its turns)."""
        return self._seq.key

    @property
    def pages_held(self) -> int:
        """Pool pages holding its KV (shared ones too)."""
        return len(self._seq.table.held_pages())

    @property
    def tier_tokens(self) -> int:
        """Tokens of its KV the second tier holds (host memory or disk)."""
        tier = self._context.tier
        return tier.tokens_held(self.key) if tier is not None else 0

    @property
    def pinned(self) -> bool:
        """Inside its pin: its pages give way only when nothing else can (soft pins)."""
        seq = self._seq
        return seq.pin_ttl is None or time.monotonic() - seq.idle_since < seq.pin_ttl

    @property
    def awaiting(self) -> tuple[str, ...] | None:
        """The tools its last turn called (None: a final answer, or no turn yet)."""
        return self._seq.awaiting

    def end_turn(self, tools: list[str], expected_s: float | None = None) -> None:
        """Tell the retention policy how the turn ended: on calls to these
        tools (pinned for as long as they usually take), or with none, a
        final answer (pinned for as long as its tenant's next turns took to
        come, at lower priority); expected_s: the client's word for the
        pause, either way. Engine.chat calls it itself."""
        check_pause(expected_s)
        self._sequences.end_turn(self._seq, list(tools), expected_s)

    def retain(self, seconds: float | None = None) -> None:
        """Pin this session's pages for `seconds` from now (None: until released)."""
        if seconds is not None and not seconds >= 0:
            raise InvalidRequestError(f"retain needs seconds >= 0 or None, got {seconds!r}")
        self._sequences.retain(self._seq, seconds)

    def release(self) -> None:
        """Unpin: the pages may give way (to the second tier) as soon as room is needed."""
        self._sequences.retain(self._seq, 0.0)

    def save(self) -> bool:
        """Write this session's KV through to the second tier's disk, to be
        resumed after a restart (Engine.session with its tokens and key).
        False if the engine has no disk tier or it is full."""
        return self._sequences.persist(self._seq)

    def forget_saved(self) -> None:
        """Remove what save wrote."""
        if self._context.tier is not None:
            self._context.tier.drop(self._seq.key, persistent=True)

    def prefetch(self) -> None:
        """Bring this session's KV on disk back to host memory now (in the
        background), so that its next request restores without reading disk."""
        tier = self._context.tier
        if tier is not None:
            tier.prefetch(self._seq.key)

    def drafter(self) -> Drafter:
        """The drafter over this session's tokens (the engine's kind: spec.drafters;
        its knobs, its acceptance counts)."""
        with self._sequences.lock:
            return self._seq.draft_index(self._scheduler.drafters.new)

    def use_drafter(self, drafter: Drafter) -> None:
        """Draft from this one (anything with NGramDrafter's interface) instead."""
        self._sequences.use_drafter(self._seq, drafter)

    def _check_tokens(self, token_ids: Iterable[int]) -> list[int]:
        ids = list(token_ids)
        if not ids:
            raise InvalidRequestError("append needs at least one token")
        vocab = self._context.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} is not in [0, {vocab})")
        self._check_length(len(self) + len(ids))
        return ids

    def _check_length(self, n: int) -> None:
        limit = self._context.max_context
        if n > limit:
            raise ContextLengthError(f"{n} tokens exceed the model's context of {limit}")

    def start_append(self, token_ids: Iterable[int], *, all_logits: bool = False) -> Request:
        """Queue an append and return at once (see append); once done, the
        request's `logits` hold the wanted rows, chunk by chunk."""
        ids = self._check_tokens(token_ids)
        req = Request(self._seq, None, num_logits=len(ids) if all_logits else 1)
        self._scheduler.submit(req, ids)
        self.message_log = None
        return req

    def append(self, token_ids: Iterable[int], *, all_logits: bool = False) -> torch.Tensor:
        """Compute the KV of these tokens (and nothing held before them).
        Returns the logits after the last token [vocab], or with all_logits
        the logits after each appended token [n, vocab]."""
        req = self._scheduler.wait(self.start_append(token_ids, all_logits=all_logits))
        if req.error is not None:
            raise req.error
        logits = torch.cat(req.logits)
        return logits if all_logits else logits[-1]

    def queue(self, token_ids: Iterable[int]) -> None:
        """Hold these tokens without computing them yet: the next generate
        computes them in its first steps (chunked, batched with other work)
        and draws the first token from their last logits."""
        self._sequences.extend(self._seq, self._check_tokens(token_ids))
        self.message_log = None

    def preposition(self, token_ids: Iterable[int]) -> None:
        """Hold tokens the next turn is known to begin with (the template's
        opening of a tool result, say), computed when the scheduler has
        nothing else to do; the next turn keeps them if it does begin so,
        and truncates them otherwise. The message log stays, noting them."""
        ids = self._check_tokens(token_ids)
        self._check_length(len(self) + len(ids))
        log = self.message_log
        self._sequences.extend(self._seq, ids, preposition=True)
        self.message_log = dataclasses.replace(log, prepositioned=log.prepositioned + tuple(ids)) if log is not None else None
        self._scheduler.wake()

    def start_generate(
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
        on_tokens: OnTokens | None = None,
        grammar: Grammar | None = None,
        on_done: OnDone | None = None,
    ) -> Request:
        """Queue a generation and return at once (see generate). The request
        is done when its `done` event is set (on_done is then called); its
        `output` or `error` says how it went; `cancel()` drops it."""
        try:
            params = SamplingParams(
                temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, max_tokens=max_tokens,
                stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
            )
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        if params.stop and not self._context.has_tokenizer:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none")
        if grammar is not None and grammar.vocab_size != self._context.vocab_size:
            raise InvalidRequestError("the grammar was compiled for another vocabulary")
        if not self._seq.tokens:
            raise InvalidRequestError("generate needs a non-empty session: append a prompt first")
        self._check_length(len(self) + 1)
        state = GrammarState(grammar) if grammar is not None else None
        req = Request(self._seq, params, speculative, on_tokens, on_done, state)
        self._scheduler.submit(req)
        self.message_log = None
        return req

    def generate(self, max_tokens: int = 64, **kwargs) -> list[int]:
        """Decode up to max_tokens new tokens; they stay in the session. Stops
        after EOS (unless ignore_eos), a stop token id, or once the text ends
        with a stop string (the completing token is kept). With speculative,
        prompt-lookup drafts from the session's history are verified k+1
        tokens per forward (greedy output is identical; sampling keeps the
        model's distribution). on_tokens, if given, is called with each step's
        new tokens (streaming). With a grammar (engine.structured.request_grammar),
        every token drawn and every draft accepted is one the grammar allows,
        and generation stops where the grammar ends. Keyword arguments as
        start_generate. On error the session is as it was before."""
        req = self._scheduler.wait(self.start_generate(max_tokens, **kwargs))
        if req.error is not None:
            raise req.error
        return req.output

    def truncate(self, n: int) -> None:
        """Keep the first n tokens; pages wholly past them are released."""
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(self):
            raise InvalidRequestError(f"cannot truncate a session of {len(self)} tokens to {n!r}")
        self._sequences.truncate(self._seq, n)
        self.message_log = None

    def fork(self) -> "Session":
        """A new session sharing every page (copy-on-write on the first write
        into a shared partially filled page, by either side)."""
        child = Session(self._context, self._sequences.fork(self._seq))
        child.message_log = self.message_log
        return child

    def hold_prefix(self, n: int, seconds: float) -> "Session":
        """A fork of the first n tokens, pinned for `seconds` and not counted
        against the session limit: a prefix a client asked to have kept (a
        cache breakpoint), sharing this session's pages. Its pin is soft, as
        every pin is (engine.kv_policy), within its tenant's share first."""
        child = Session(self._context, self._sequences.fork(self._seq, counted=False))
        try:
            child.truncate(n)
            child.retain(seconds)
        except BaseException:
            child.close()
            raise
        return child

    def fork_for_turn(self) -> "Session":
        """A fork that also takes over this session's draft index (kept in step
        lazily: whichever side ends up with it re-syncs from its tokens), so a
        turn worked on a fork need not rebuild it, and shares this session's
        KV in the second tier. It ends this session's tool pause (the
        retention policy learns from it). See Engine.chat."""
        child = Session(self._context, self._sequences.fork(self._seq, for_turn=True))
        self._sequences.hand_over_drafter(self._seq, child._seq)
        child.message_log = self.message_log
        return child

    def adopt(self, other: "Session") -> None:
        """Take over other's tokens and pages (other is closed), releasing ours."""
        self._sequences.adopt(self._seq, other._seq)
        self.message_log = None

    def keep(self) -> None:
        """A record outside the engine names this session (a named session, a
        stored response): the idle timeout moves its KV out of the pool (to
        the second tier and the prefix cache) instead of closing it."""
        self._sequences.keep(self._seq)

    def park(self) -> None:
        """Move this idle session's KV out of the pool now (to the second
        tier, when the engine has one, and the prefix cache); its tokens
        stay, and its next request restores or re-matches them."""
        self._sequences.park(self._seq)

    def close(self) -> None:
        self._sequences.close(self._seq)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
