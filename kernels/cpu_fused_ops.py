"""Fused per-layer CPU ops (kernels/cpu_fused_ops.cpp): residual add +
RMSNorm, and RoPE + K/V store, one torch op each where their references
(kernels/reference.py) run 9-17. A decode step of a small model pays more for
dispatching ops than for their arithmetic: on the embedded model (5 layers)
these two take about 140 ops a step away.

Both give the references' bits: the same roundings in the same order, the
sum of squares in ATen's order (which follows its vector width), and
no fused multiply-adds (built with -ffp-contract=off). Every row is computed
on its own, so a row's bits do not depend on the batch.

The extension is compiled on first use (kernels/cpu_extension.py); without a
compiler, CpuKernelUnavailable, and kernels.dispatch.select keeps the references (one
warning).
"""
from __future__ import annotations

from pathlib import Path

import torch

from agentkv.kernels import cpu_extension
from agentkv.kernels.cpu_extension import CpuKernelUnavailable  # noqa: F401 (what extension.load() raises, for callers)
from agentkv.kernels.metadata import AttnMetadata

SOURCE = Path(__file__).with_suffix(".cpp")

DTYPES = (torch.float32, torch.bfloat16)

# The width of ATen's vectors where it runs its AVX512 kernels (aten::silu's,
# whose element-to-path split silu_mul follows), else AVX2's.
VECTOR_BYTES = 64 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 32

extension = cpu_extension.Extension(
    "agentkv_cpu_fused", SOURCE, "agentkv_cpu_fused", lambda library: getattr(torch.ops, library),
    cflags=["-ffp-contract=off"],
)
build_error, available = extension.build_error, extension.available


def supports(x: torch.Tensor) -> bool:
    """CPU fp32 and bf16 (weights, caches and the other inputs of x's dtype)."""
    return x.device.type == "cpu" and x.dtype in DTYPES


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rmsnorm: with a residual, h = x + residual and (weight * h /
    rms(h), h); without, (weight * x / rms(x), x). x, residual and weight
    contiguous, of one dtype (ValueError otherwise)."""
    ops = extension.load()
    if residual is None:
        return ops.rmsnorm(x, weight, eps), x
    return ops.add_rmsnorm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """reference.silu_mul: silu(gate) * up for rows [gate | up] [T, 2 * n]
    with contiguous rows."""
    return extension.load().silu_mul(gate_up, VECTOR_BYTES)


def rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """reference.rope_and_store, with q rotated in place (and returned): its
    rows are the caller's (a forward's fresh qkv projection), and a copy
    would cost an op a layer. k and v are left as they are. Any strides; a
    position or slot out of range raises IndexError before anything is written.
    With q_norm and k_norm, q and k are normalized by rmsnorm first (into
    fresh tensors: it takes contiguous rows), as kernels/cpu_layers.cpp does."""
    ops = extension.load()
    if q_norm is not None:
        q, k = ops.rmsnorm(q.contiguous(), q_norm, eps), ops.rmsnorm(k.contiguous(), k_norm, eps)
    ops.rope_and_store(q, k, v, cos, sin, k_cache, v_cache, meta.positions, meta.slot_mapping)
    return q
