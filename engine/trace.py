"""The engine's trace hooks: NVTX ranges that name its phases (prefill,
decode, verify) on an Nsight Systems timeline; a no-op where CUDA is absent.
They live in the engine, which calls them, so that the engine imports nothing
from profiling/ (whose tools import the engine and experiments/)."""
from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch


@functools.cache
def _cuda() -> bool:
    # Asked once: the answer holds for the process, and asking costs a few
    # microseconds a step where there is no GPU.
    return torch.cuda.is_available()


def nvtx_range(name: str) -> AbstractContextManager[None]:
    return _pushed(name) if _cuda() else nullcontext()


@contextmanager
def _pushed(name: str) -> Iterator[None]:
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
