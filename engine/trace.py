"""The engine's trace hooks: spans that name its phases (a step's prefill,
decode or verify; rendering, tokenizing, sampling, detokenizing, parsing tool
calls). Each is an NVTX range on an Nsight Systems timeline where CUDA is,
and, while a span listener is registered (profiling.breakdown), a
torch.profiler range whose seconds every listener is told. With neither, a
span costs a call and a check. They live in the engine, which calls them, so
that the engine imports nothing from profiling/ (whose tools import the
engine and experiments/)."""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

log = logging.getLogger("agentkv.trace")

SpanListener = Callable[[str, float], None]  # (span name, seconds), at the span's end
_listeners: tuple[SpanListener, ...] = ()


@functools.cache
def _cuda() -> bool:
    # Asked once: the answer holds for the process, and asking is not free
    # where there is no GPU, on a path taken every step.
    return torch.cuda.is_available()


# One for every call without CUDA: spans sit on the per-step path.
_NO_RANGE = nullcontext()


def nvtx_range(name: str) -> AbstractContextManager[None]:
    return _pushed(name) if _cuda() else _NO_RANGE


@contextmanager
def _pushed(name: str) -> Iterator[None]:
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def span(name: str) -> AbstractContextManager[None]:
    """A named phase: an NVTX range, timed for the span listeners while any listens."""
    return _timed(name) if _listeners else nvtx_range(name)


def add_span_listener(listener: SpanListener) -> None:
    """listener(name, seconds) is called at the end of every span from now on, on the thread that ran it."""
    global _listeners
    _listeners += (listener,)


def remove_span_listener(listener: SpanListener) -> None:
    """ValueError if listener was never added."""
    global _listeners
    if listener not in _listeners:
        raise ValueError("that listener is not registered")
    _listeners = tuple(x for x in _listeners if x != listener)  # bound methods are equal, never the same


@contextmanager
def _timed(name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        with torch.profiler.record_function(name), nvtx_range(name):
            yield
    finally:
        seconds = time.perf_counter() - start
        for listener in _listeners:
            try:
                listener(name, seconds)
            except Exception:  # a listener's bug is its own: the engine goes on
                log.exception("a span listener failed")
