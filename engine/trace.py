"""The engine's trace hooks: NVTX ranges that name its phases (prefill,
decode, verify) on an Nsight Systems timeline; a no-op where CUDA is absent.
They live in the engine, which calls them, so that the engine imports nothing
from profiling/ (whose tools import the engine and experiments/)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
