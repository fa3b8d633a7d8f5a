"""Which implementation runs each per-layer op: Triton on CUDA tensors, the
C++ CPU kernels where their extensions build, the torch reference otherwise
(with one warning); ``AGENTKV_KERNELS=torch`` or ``=triton`` forces either.

A forward chooses once (select): the model's layers then call the chosen
implementations with no dispatch decision, and the environment is read once
a step rather than at every op of every layer.
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from agentkv.kernels import (
    cpu_chunk_attention, cpu_extension, cpu_fused_ops, cpu_layers, cpu_linear, cpu_paged_attention, reference,
)
from agentkv.kernels.metadata import AttnMetadata

__all__ = [
    "AttnMetadata", "StepKernels", "select", "paged_attention", "rope_and_store", "rmsnorm", "copy_pages",
    "verify_drafts", "use_triton",
]


CPU_KERNELS = (cpu_linear, cpu_fused_ops, cpu_paged_attention, cpu_chunk_attention, cpu_layers)


def build_cpu_kernels() -> dict[str, str]:
    """Builds every C++ CPU kernel for this ISA now (or loads it from the
    cache), so that no request and no timed run pays for a compile: a
    server calls it before it listens, a benchmark before its clock
    starts. Returns the build error of each kernel that could not be built
    (the torch paths run those)."""
    cpu_extension.isa()
    return {m.__name__.rpartition(".")[2]: m.extension.build_error() for m in CPU_KERNELS
            if not m.extension.available()}


def _mode() -> str:
    mode = os.environ.get("AGENTKV_KERNELS", "auto")
    if mode not in ("auto", "torch", "triton"):
        raise ValueError(f"AGENTKV_KERNELS must be auto, torch or triton, not {mode!r}")
    return mode


def use_triton(t: torch.Tensor) -> bool:
    mode = _mode()
    return mode == "triton" or (mode == "auto" and t.is_cuda)


_warned: list[str] = []
_warned_fused: list[str] = []
_warned_layers: list[str] = []
_warned_chunks: list[str] = []


def _built(extension, warned: list[str], fallback: str) -> bool:
    """Whether a C++ extension module (kernels/cpu_*.py) is built; the first
    time it is not, one warning that `fallback` runs instead."""
    if extension.available():
        return True
    if not warned:
        warned.append(extension.build_error())
        warnings.warn(f"{fallback}: {warned[0]}", RuntimeWarning, stacklevel=4)
    return False


# Whether the C++ attention kernels beat the torch path (kernels/reference.py)
# on an ISA's build, as experiments/benchmarks/bench_cpu_ops measures them (and keeps
# true: docs/bench_cpu_ops.md); where one does not, the torch path runs
# attention and the layers run in Python, with the C++ linears and fused ops.
# Built from 16-lane tiles on AVX2 too, the chunk kernel ran far slower than
# the torch path there (round 3); from 8-lane ones both kernels win (round 4).
CPP_ATTENTION_WINS = {"avx512": True, "avx2": True, "native": True}


def _use_cpu_attention(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    if _mode() != "auto" or not CPP_ATTENTION_WINS[cpu_extension.isa()] or not cpu_paged_attention.supports(q, k_cache):
        return False
    return _built(cpu_paged_attention, _warned, "CPU attention runs the slower torch reference")


def _use_cpu_fused(x: torch.Tensor) -> bool:
    if _mode() != "auto" or not cpu_fused_ops.supports(x):
        return False
    return _built(cpu_fused_ops, _warned_fused, "RMSNorm and RoPE run the slower torch references")


def _use_cpu_layers() -> bool:
    return _built(cpu_layers, _warned_layers, "The CPU forward runs its layers in Python")


def _triton(module: str, name: str):
    # Imported on first use so that a CPU-only run never imports triton.
    return getattr(importlib.import_module(f"agentkv.kernels.triton_{module}"), name)


def _rmsnorm_impl(x: torch.Tensor, triton: bool) -> Callable:
    if triton:
        return _triton("rmsnorm", "rmsnorm")
    return cpu_fused_ops.rmsnorm if _use_cpu_fused(x) else reference.rmsnorm


def _rope_impl(q: torch.Tensor, triton: bool) -> Callable:
    if triton:
        return _triton("rope_and_store", "rope_and_store")
    return cpu_fused_ops.rope_and_store if _use_cpu_fused(q) else reference.rope_and_store


# The decode/verify kernel with the chunk kernel for the longer sequences of a
# step (the torch reference takes them where the chunk kernel does not build).
_cpu_attention_with_chunks = functools.partial(
    cpu_paged_attention.paged_attention, chunks=cpu_chunk_attention.chunk_attention_into
)


def _attention_impl(q: torch.Tensor, k_cache: torch.Tensor, triton: bool) -> Callable:
    if triton:
        return _triton("paged_attention", "paged_attention")
    if _use_cpu_attention(q, k_cache):
        # Both kernels take the same shapes (cpu_chunk_attention.supports is the decode kernel's).
        if _built(cpu_chunk_attention, _warned_chunks, "Prompt chunks' attention runs the slower torch reference"):
            return _cpu_attention_with_chunks
        return cpu_paged_attention.paged_attention
    return reference.paged_attention


@dataclass(frozen=True, slots=True)
class StepKernels:
    """The implementations of the per-layer ops one forward runs, with the
    signatures of the dispatchers below. rope_and_store may rotate q in
    place (the C++ one does): callers use what it returns and keep no copy
    of q's unrotated rows. layer_loop: all four are the C++ ones and the
    loop over layers that calls them builds (kernels/cpu_layers.py), so a
    forward whose linears are the C++ ones too may run its layers there."""

    rmsnorm: Callable
    rope_and_store: Callable
    paged_attention: Callable
    silu_mul: Callable
    layer_loop: bool = False


_selected: dict[tuple, StepKernels] = {}


def select(x: torch.Tensor, k_cache: torch.Tensor) -> StepKernels:
    """What the dispatchers below would run for a forward whose activations
    are like x and whose layers' K pages are like k_cache (one layer's
    [P, page_size, Hkv, D]), decided once for all its layers and ops."""
    mode = _mode()
    # The build's state is part of the key: a build that fails (or is made
    # to fail, as tests do) changes the choice from the next forward on.
    isa = cpu_extension.isa()
    key = (mode, isa, CPP_ATTENTION_WINS[isa], x.device, x.dtype, k_cache.dtype, k_cache.shape[-1], k_cache.stride(-1),
           cpu_paged_attention.build_error(), cpu_chunk_attention.build_error(), cpu_fused_ops.build_error(),
           cpu_layers.build_error())
    chosen = _selected.get(key)
    if chosen is None:
        triton = mode == "triton" or (mode == "auto" and x.is_cuda)
        # A query [T, Hq, D] agrees with one K row [Hkv, D] on all the CPU
        # kernel asks of it (device, dtype, head_dim) when the dtypes agree.
        q_like = k_cache[0, 0] if x.dtype == k_cache.dtype else x
        # The fused C++ ops take one dtype for activations, weights and caches.
        fused = triton or x.dtype == k_cache.dtype
        impls = dict(
            rmsnorm=_rmsnorm_impl(x, triton) if fused else reference.rmsnorm,
            rope_and_store=_rope_impl(x, triton) if fused else reference.rope_and_store,
            paged_attention=_attention_impl(q_like, k_cache, triton),
            # On GPUs the reference's two elementwise ops are two launches.
            silu_mul=cpu_fused_ops.silu_mul if not triton and _use_cpu_fused(x) else reference.silu_mul,
        )
        in_cpp = (
            impls["rmsnorm"] is cpu_fused_ops.rmsnorm and impls["rope_and_store"] is cpu_fused_ops.rope_and_store
            and impls["silu_mul"] is cpu_fused_ops.silu_mul
            and impls["paged_attention"] in (cpu_paged_attention.paged_attention, _cpu_attention_with_chunks)
        )
        chosen = StepKernels(**impls, layer_loop=in_cpp and _use_cpu_layers())
        _selected[key] = chosen
    return chosen


def paged_attention(
    q, k_cache, v_cache, meta: AttnMetadata, scale: float, sliding_window: int = 0, out: torch.Tensor | None = None
) -> torch.Tensor:
    impl = _attention_impl(q, k_cache, use_triton(q))
    return impl(q, k_cache, v_cache, meta, scale, sliding_window, out=out)


def rope_and_store(
    q, k, v, cos, sin, k_cache, v_cache, meta: AttnMetadata, q_norm=None, k_norm=None, eps: float = 0.0
) -> torch.Tensor:
    triton = use_triton(q)
    impl = _rope_impl(q, triton) if triton or q.dtype == k_cache.dtype else reference.rope_and_store
    return impl(q, k, v, cos, sin, k_cache, v_cache, meta, q_norm, k_norm, eps)


def rmsnorm(x, weight, eps: float, residual=None) -> tuple[torch.Tensor, torch.Tensor]:
    triton = use_triton(x)
    impl = _rmsnorm_impl(x, triton) if triton or x.dtype == weight.dtype else reference.rmsnorm
    return impl(x, weight, eps, residual)


def copy_pages(kv, src, dst) -> None:
    impl = _triton("copy_pages", "copy_pages") if use_triton(kv) else reference.copy_pages
    impl(kv, src, dst)


def verify_drafts(target, cu_rows, drafts, draft_lens, uniforms=None) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _triton("verify_drafts", "verify_drafts") if use_triton(target) else reference.verify_drafts
    return impl(target, cu_rows, drafts, draft_lens, uniforms)
