"""One blocking engine call on its own thread, seen from the event loop.

The engine's calls block until the scheduler has finished the request, and
report each step's new tokens from the scheduler thread. A Generation runs the
call on a thread of its own (not the shared thread pool, so that many waiting
requests never starve the server's other handlers) and hands the tokens and
the outcome to the event loop. Nothing here can stop the call: the engine has
no way to cancel a request, so a call always runs to its end.
"""
from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Callable, Generic, TypeVar

T = TypeVar("T")
OnTokens = Callable[[list[int]], None]


class Generation(Generic[T]):
    def __init__(self, call: Callable[[OnTokens], T]):
        self._loop = asyncio.get_running_loop()
        self._tokens: asyncio.Queue[list[int] | None] = asyncio.Queue()  # None: the call has returned
        self._done = asyncio.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._stash: list[list[int] | None] = []  # the item started() took off the queue
        threading.Thread(target=self._run, args=(call,), name="agentkv-request", daemon=True).start()

    def _run(self, call: Callable[[OnTokens], T]) -> None:
        try:
            result, error = call(self._on_tokens), None
        except BaseException as e:  # handed to the awaiting handler, which maps it to an HTTP error
            result, error = None, e
        self._post(self._settle, result, error)

    def _on_tokens(self, ids: list[int]) -> None:
        self._post(self._tokens.put_nowait, list(ids))

    def _post(self, fn: Callable, *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server has shut down and nobody is waiting
            pass

    def _settle(self, result: T | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()
        self._tokens.put_nowait(None)

    async def started(self) -> None:
        """Wait for the first tokens or the end; raise the call's error if it
        failed before producing any token (so the handler can still answer
        with an HTTP error status instead of a stream)."""
        first = await self._tokens.get()
        self._stash.append(first)
        if first is None and self._error is not None:
            raise self._error

    async def tokens(self) -> AsyncIterator[list[int]]:
        """Each step's new tokens, until the call returns."""
        ids = self._stash.pop() if self._stash else await self._tokens.get()
        while ids is not None:
            yield ids
            ids = await self._tokens.get()

    async def result(self) -> T:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result
