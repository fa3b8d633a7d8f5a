"""NVTX ranges that name the engine's phases (prefill, decode, verify) on an
Nsight Systems timeline; a no-op where CUDA is absent."""
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
