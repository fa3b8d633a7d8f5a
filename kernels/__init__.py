"""Kernel ops with one torch reference and one Triton implementation each.

Dispatch by device: CUDA tensors run Triton, CPU tensors run the torch
reference. ``AGENTKV_KERNELS=torch`` or ``=triton`` forces either (Triton on a
CPU needs ``TRITON_INTERPRET=1`` set before triton is imported).
"""
from __future__ import annotations

import importlib
import os
import sys
import types

import torch

from kernels import reference
from kernels.metadata import AttnMetadata

__all__ = ["AttnMetadata", "paged_attention", "rope_and_store", "rmsnorm", "copy_pages", "verify_drafts", "use_triton"]
_OPS = frozenset(__all__) - {"AttnMetadata", "use_triton"}


class _Package(types.ModuleType):
    """Importing the Triton module kernels.<op> binds it as the package's
    attribute <op>, which would replace the dispatcher of the same name for
    every later caller; the dispatchers keep their names."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _OPS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def use_triton(t: torch.Tensor) -> bool:
    mode = os.environ.get("AGENTKV_KERNELS", "auto")
    if mode not in ("auto", "torch", "triton"):
        raise ValueError(f"AGENTKV_KERNELS must be auto, torch or triton, not {mode!r}")
    return mode == "triton" or (mode == "auto" and t.is_cuda)


def _triton(module: str, name: str):
    # Imported on first use so that a CPU-only run never imports triton.
    return getattr(importlib.import_module(f"kernels.{module}"), name)


def paged_attention(q, k_cache, v_cache, meta: AttnMetadata, scale: float, sliding_window: int = 0) -> torch.Tensor:
    impl = _triton("paged_attention", "paged_attention") if use_triton(q) else reference.paged_attention
    return impl(q, k_cache, v_cache, meta, scale, sliding_window)


def rope_and_store(q, k, v, cos, sin, k_cache, v_cache, meta: AttnMetadata) -> torch.Tensor:
    impl = _triton("rope_and_store", "rope_and_store") if use_triton(q) else reference.rope_and_store
    return impl(q, k, v, cos, sin, k_cache, v_cache, meta)


def rmsnorm(x, weight, eps: float, residual=None) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _triton("rmsnorm", "rmsnorm") if use_triton(x) else reference.rmsnorm
    return impl(x, weight, eps, residual)


def copy_pages(kv, src, dst) -> None:
    impl = _triton("copy_pages", "copy_pages") if use_triton(kv) else reference.copy_pages
    impl(kv, src, dst)


def verify_drafts(target, cu_rows, drafts, draft_lens, uniforms=None) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _triton("verify_drafts", "verify_drafts") if use_triton(target) else reference.verify_drafts
    return impl(target, cu_rows, drafts, draft_lens, uniforms)
