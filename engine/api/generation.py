"""One engine request seen from the event loop, with no thread of its own.

A request is begun off the loop (rendering and tokenizing are CPU work, and
session operations wait for the step in flight) on the server's bounded
worker pool; it then runs in the scheduler's steps while the handler awaits
it. The scheduler thread reports each step's new tokens and the end through
callbacks posted to the loop. Finishing (handing the reply to its session,
storing a response) runs on the worker pool again.

A client that goes away cancels its request: the scheduler drops it within
one step, its session is left as before the request, and the finishing half
still runs (in the background) so that every page and lease is given back.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable, Generic, Protocol, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest

from agentkv.engine import OnDone, OnTokens

T = TypeVar("T", covariant=True)
log = logging.getLogger("agentkv.api")

# How often a non-streaming handler checks whether its client is still there.
DISCONNECT_POLL_S = 0.1


class Pending(Protocol[T]):
    """A begun engine request: cancel() asks the scheduler to drop it;
    finish() (once it is done) completes it and returns its result, or
    raises its error."""

    def cancel(self) -> None: ...

    def finish(self) -> T: ...


class Generation(Generic[T]):
    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tokens: asyncio.Queue[list[int] | None] = asyncio.Queue()  # None: the request is done
        self._done = asyncio.Event()
        self._pending: Pending[T] | None = None
        self._finished: asyncio.Future[T] | None = None
        self._stash: list[list[int] | None] = []  # the item started() took off the queue

    @classmethod
    async def begin(cls, begin: Callable[[OnTokens, OnDone], Pending[T]]) -> "Generation[T]":
        """Run begin(on_tokens, on_done) on the worker pool; its errors (a
        bad request, a full queue) are raised here, before any response."""
        gen = cls()
        gen._pending = await run_in_threadpool(begin, gen._on_tokens, gen._on_done)
        return gen

    @property
    def pending(self) -> Pending[T]:
        """The begun request (what begin returned)."""
        return self._pending

    def _on_tokens(self, ids: list[int]) -> None:
        self._post(self._tokens.put_nowait, list(ids))

    def _on_done(self, _request: object) -> None:
        self._post(self._settle)

    def _post(self, fn: Callable, *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server has shut down and nobody is waiting
            pass

    def _settle(self) -> None:
        self._done.set()
        self._tokens.put_nowait(None)

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()

    async def started(self, request: HTTPRequest) -> None:
        """Wait for the first tokens or the end; raise the request's error if
        it failed before producing any token (so the handler can still answer
        with an HTTP error status instead of a stream). A client that goes
        away meanwhile (queued, or in a long prefill) cancels the request."""
        while True:
            try:
                first = await asyncio.wait_for(self._tokens.get(), DISCONNECT_POLL_S)
                break
            except TimeoutError:
                if await request.is_disconnected():
                    self.cancel()
                    first = await self._tokens.get()  # the end, within a step
                    break
        self._stash.append(first)
        if first is None:
            await self.result()

    async def tokens(self) -> AsyncIterator[list[int]]:
        """Each step's new tokens, until the request is done."""
        ids = self._stash.pop() if self._stash else await self._tokens.get()
        while ids is not None:
            yield ids
            ids = await self._tokens.get()

    async def result(self) -> T:
        """The finished request's result (finishing it once, on the worker pool)."""
        await self._done.wait()
        if self._finished is None:
            self._finished = asyncio.ensure_future(run_in_threadpool(self._pending.finish))
        return await asyncio.shield(self._finished)

    async def result_unless_gone(self, request: HTTPRequest) -> T:
        """result(), cancelling the request if its client disconnects meanwhile."""
        while not self._done.is_set():
            try:
                await asyncio.wait_for(self._done.wait(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    self.cancel()
        return await self.result()

    def abandon(self) -> None:
        """The client went away mid-stream: cancel, and finish in the
        background so that the session and its lease are given back."""
        self.cancel()
        task = asyncio.ensure_future(self.result())
        task.add_done_callback(_quietly)


def _quietly(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("an abandoned request ended with %r", task.exception())
