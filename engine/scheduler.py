"""Continuous batching: every step packs the work of all active requests into
one ragged forward.

A request's step is always "compute the session's pending tokens": prompt
tokens not yet computed (a chunk of them under the step's token budget), or
the one token drawn last step, followed by draft tokens when speculating.
Once a request's chunk reaches the end of its session, the logits of the
chunk's last token (and of each draft token) decide what is emitted: the
drafts a verify accepts, then one token drawn by the target. A plain decode
step is the same with no drafts. A request with a grammar drafts only what
the grammar allows and has each of its rows masked before the verify, so
constrained requests share the batched step like any other.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

import kernels
from cache.errors import KVCapacityError
from engine.errors import EngineError
from engine.grammar import GrammarState
from engine.runner import StepItem
from profiling.nvtx import nvtx_range
from model.sampler import SamplingParams, draw_uniforms, make_generator, probs_from_logits

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.session import Session


@dataclass(eq=False)
class Request:
    session: "Session"
    params: SamplingParams
    speculative: bool = True
    on_tokens: Callable[[list[int]], None] | None = None  # streaming: called with each step's new tokens
    grammar: GrammarState | None = None  # constrains every token drawn and every draft accepted
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length"
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    start_len: int = 0
    generator: torch.Generator | None = None
    stop_ids: frozenset[int] = frozenset()
    ready_logits: torch.Tensor | None = None  # next-token logits the session already had

    @property
    def pending(self) -> int:
        return len(self.session._tokens) - self.session.table.length


def _phase(items: list[StepItem], drafts: list[list[int] | None]) -> str:
    """Name a step for the profiler timeline by the heaviest work in it."""
    if any(d is None or len(it.tokens) > len(d) + 1 for it, d in zip(items, drafts)):
        return "prefill"
    return "verify" if any(drafts) else "decode"


class Scheduler:
    def __init__(self, engine: "Engine", token_budget: int = 2048):
        self.engine = engine
        self.token_budget = token_budget
        self.active: list[Request] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def serving(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Step in a background thread, so that requests from many threads
        (a server's handlers) share each forward."""
        if self.serving:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="agentkv-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the background loop; requests still active fail (rolled back)
        rather than wait forever."""
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
            self._thread.join()
            self._thread = None
        with self.engine.lock:
            for req in list(self.active):
                self._fail(req, EngineError("the scheduler stopped before the request finished"))

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.active:
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            self.step()

    def submit(self, req: Request) -> None:
        with self.engine.lock:
            self._submit(req)
        self._wake.set()

    def _submit(self, req: Request) -> None:
        s = req.session
        req.start_len = len(s._tokens)
        req.generator = None if req.params.greedy else make_generator(req.params.seed)
        stop = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            stop.update(self.engine.eos_token_ids)
        req.stop_ids = frozenset(stop)
        if s.table.length == len(s._tokens):
            if s._last_logits is not None:
                req.ready_logits = s._last_logits[None]
            else:
                # No logits after truncate or fork: make the last token
                # pending again so this request's first step computes them.
                s.table.truncate(len(s._tokens) - 1)
        with self._lock:
            self.active.append(req)

    def run(self, req: Request) -> list[int]:
        """Drive steps until req is done; re-raise its error."""
        self.submit(req)
        if self.serving:
            req.done.wait()
        while not req.done.is_set():
            self.step()
        if req.error is not None:
            raise req.error
        return req.output

    def step(self) -> None:
        with self.engine.lock:
            self._step()

    def _step(self) -> None:
        with self._lock:
            batch = list(self.active)
        for req in batch:
            if req.ready_logits is not None:
                rows, req.ready_logits = req.ready_logits, None
                self._emit(req, [], rows, 0.0, 0)
        batch = [req for req in batch if not req.done.is_set()]
        if not batch:
            return
        items, drafts = [], []
        budget = self.token_budget
        for req in batch:
            s = req.session
            take = min(req.pending, max(budget, 1))
            budget -= take
            finishing = take == req.pending
            draft = self._draft(req) if finishing else []
            chunk = s._tokens[s.table.length : s.table.length + take] + draft
            items.append(StepItem(s.table, chunk, len(draft) + 1))
            drafts.append(draft if finishing else None)
        start = time.perf_counter()
        try:
            with nvtx_range(_phase(items, drafts)):
                logits = self.engine.runner.step(items)
        except KVCapacityError as e:
            self._fail(batch[-1], e)  # the newest request gives way; the rest retry next step
            return
        except BaseException as e:
            for req in batch:
                self._fail(req, e)
            return
        elapsed = time.perf_counter() - start
        for req, item, draft, rows in zip(batch, items, drafts, logits):
            if draft is None:  # a prompt chunk short of the end: nothing to emit yet
                req.session.turn.prefill_s += elapsed
                req.session.turn.computed_tokens += len(item.tokens)
                continue
            self._emit(req, draft, rows, elapsed, len(item.tokens) - len(draft))

    def _draft(self, req: Request) -> list[int]:
        s = req.session
        room = min(req.params.max_tokens - len(req.output), self.engine.max_context - len(s._tokens)) - 1
        if not req.speculative or room < 1 or not req.output:
            return []
        drafter = s.drafter()
        k = min(drafter.draft_len, room)
        draft = drafter.propose(k) if k > 0 else []
        # A draft token the grammar forbids could never be accepted, nor anything after it.
        return req.grammar.clip(draft) if req.grammar is not None and draft else draft

    def _emit(self, req: Request, draft: list[int], rows: torch.Tensor, elapsed: float, chunk: int) -> None:
        s = req.session
        if not req.output:  # the prompt's last chunk
            s.turn.prefill_s += elapsed
            s.turn.computed_tokens += chunk
        else:
            s.turn.decode_s += elapsed
            s.turn.decode_steps += 1
        if req.grammar is not None:
            rows = req.grammar.masked(rows, draft)
        device = rows.device
        drafts_t = torch.tensor([draft + [0] * (not draft)], dtype=torch.int64, device=device)
        cu = torch.tensor([0, len(draft) + 1], dtype=torch.int32, device=device)
        lens = torch.tensor([len(draft)], dtype=torch.int32, device=device)
        if req.params.greedy:
            accepted, nxt = kernels.verify_drafts(rows, cu, drafts_t, lens)
        else:
            u = draw_uniforms([req.generator] * (len(draft) + 1), len(draft) + 1)[None].to(device)
            accepted, nxt = kernels.verify_drafts(probs_from_logits(rows, req.params), cu, drafts_t, lens, u)
        n_acc = int(accepted[0])
        if draft:
            s.drafter().record(len(draft), n_acc)
            s.turn.drafted_tokens += len(draft)
            s.turn.accepted_tokens += n_acc
            s.turn.verify_steps += 1
        new = draft[:n_acc] + [int(nxt[0])]
        for i in range(len(new)):
            if req.grammar is not None and not req.grammar.accept(new[i]):
                self._fail(req, EngineError(f"token {new[i]} was drawn against the grammar"))
                return
            if self._stops(req, req.output + new[: i + 1], len(s._tokens) + i + 1):
                new = new[: i + 1]
                break
        # KV was computed for the chunk's last token and every draft; keep it
        # for the accepted ones only, the newest emitted token stays pending.
        s._tokens.extend(new)
        s.table.truncate(min(s.table.length, len(s._tokens) - 1))
        s._invalidate_logits()
        req.output.extend(new)
        s.turn.generated_tokens += len(new)
        if req.on_tokens is not None:
            try:
                req.on_tokens(new)
            except Exception as e:  # a consumer's failure ends its own request only
                self._fail(req, e)
                return
        if req.finish_reason is not None:
            self._finish(req)

    def _stops(self, req: Request, out: list[int], n_total: int) -> bool:
        """Whether the output `out` ends the request (sets its finish reason)."""
        p = req.params
        if out[-1] in req.stop_ids or (req.grammar is not None and req.grammar.terminated):
            req.finish_reason = "stop"
        elif p.stop and req.session.ends_with_stop(out, p.stop):
            req.finish_reason = "stop"
        elif len(out) >= p.max_tokens or n_total >= self.engine.max_context:
            req.finish_reason = "length"
        return req.finish_reason is not None

    def _finish(self, req: Request) -> None:
        with self._lock:
            self.active.remove(req)
        req.done.set()

    def _fail(self, req: Request, error: BaseException) -> None:
        req.session._rollback(req.start_len)
        req.error = error
        req.output = []
        self._finish(req)
