"""CPU linears that stream their weights (kernels/cpu_linear.cpp).

A weight stored [in, out] is packed once (pack) into blocks of 16 outputs laid
out in the order the kernel reads them: fp32 [out/16][in][16], bf16
[out/16][ceil(in/2)][16][2] (input pairs, as vdpbf16ps takes them), zero-padded
to whole blocks and pairs. linear() then reads each block front to back, both
cores on their own share of the blocks, accumulating in fp32 in input order,
so a row's bits do not depend on how many rows share the call.

The extension is compiled on first use (kernels/cpu_extension.py) with the
AVX512 (fp32) and AVX512-BF16 (bf16) code this CPU runs, and AMX tiles for
bf16 where it has them (amx()); dtypes() says which dtypes it got. Without a compiler, CpuKernelUnavailable (callers fall back to oneDNN).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from agentkv.kernels import cpu_extension
from agentkv.kernels.cpu_extension import CpuKernelUnavailable

SOURCE = Path(__file__).with_suffix(".cpp")
BLOCK = 16  # outputs per packed block (kernels/cpu_linear.cpp's kBlock)

extension = cpu_extension.Extension(
    "agentkv_cpu_linear", SOURCE, "agentkv_cpu_linear", lambda library: getattr(torch.ops, library),
    headers=[cpu_extension.AMX_HEADER],
)
build_error = extension.build_error


def dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes the kernel runs on this CPU (building it on the first
    call); () when it cannot be built."""
    try:
        return tuple(getattr(torch, name) for name in extension.load().dtypes())
    except CpuKernelUnavailable:
        return ()


def amx() -> bool:
    """Whether bf16 weights whose inputs are a multiple of 32 run on the AMX
    tile unit here (built with it, and the tile state granted)."""
    try:
        return bool(extension.load().amx())
    except CpuKernelUnavailable:
        return False


@dataclass(frozen=True)
class PackedLinear:
    """A weight in the kernel's layout: data [blocks, block_len], and its
    [in, out] shape."""

    data: torch.Tensor
    in_features: int
    out_features: int


def pack(weight: torch.Tensor) -> PackedLinear:
    """The kernel's copy of a CPU fp32 or bf16 weight stored [in, out]."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2:
        raise ValueError(f"a CPU fp32/bf16 [in, out] weight, not {weight.device} {weight.dtype} {tuple(weight.shape)}")
    n_in, n_out = weight.shape
    blocks = -(-n_out // BLOCK)
    w = F.pad(weight.detach(), (0, blocks * BLOCK - n_out))
    if weight.dtype == torch.float32:
        data = w.view(n_in, blocks, BLOCK).permute(1, 0, 2)
    else:
        pairs = -(-n_in // 2)
        w = F.pad(w, (0, 0, 0, 2 * pairs - n_in))
        data = w.view(pairs, 2, blocks, BLOCK).permute(2, 0, 3, 1)
    return PackedLinear(data.contiguous().view(blocks, -1), n_in, n_out)


def linear(x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ weight (+ bias) -> [T, out] in x's dtype, with the weight as
    pack made it; fp32 sums, the bias added to the sum, rounded once."""
    if x.dim() != 2 or x.shape[1] != packed.in_features or x.dtype != packed.data.dtype:
        raise ValueError(
            f"x must be [T, {packed.in_features}] {packed.data.dtype}, not {tuple(x.shape)} {x.dtype}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    return extension.load().linear(x, packed.data, bias, packed.out_features)
