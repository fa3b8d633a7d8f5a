"""Packed CPU linears: the weight-streaming C++ kernel (kernels/cpu_linear.py)
where it runs, else oneDNN with weights packed once into its blocked layout.

With oneDNN: its plain bf16 matmul is slow for thin inputs, and both dtypes
gain on a few rows from packing (docs/bench_cpu_linear.md). The packed
kernels also give each row the same result however many rows share the
call (PackedWeights.linear runs oneDNN in calls of ROWS rows), which plain
matmuls on CPU do not.

The C++ kernel reads the weights of a decode step at close to memory
bandwidth where oneDNN reaches less, and on prefill chunks matches oneDNN
(AMX tiles where the CPU has them, AVX-512 where not; docs/bench_cpu_linear.md),
so where it builds it runs every linear.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from agentkv.kernels import cpu_linear


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch build and CPU run oneDNN linears in this dtype
    (fp16 is left out: without AVX512-FP16 oneDNN converts it slowly)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def pack(weight: torch.Tensor) -> torch.Tensor:
    """An opaque oneDNN copy of a weight stored [in, out]."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.t().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight (+ bias) for rows x [T, in], with the weight as pack made it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# oneDNN picks its kernel by the rows of a call (one row, a few, hundreds: on
# an AMX host rows 64-512 of one call differ in their last bits from the same
# rows in calls of 16 or 2048), so every call runs as calls of exactly this
# many rows, the last padded with zero rows dropped after: one kernel, one
# summation order per row, whatever shares it.
ROWS = 16

KERNELS = ("cpp", "onednn")

_warned: list[str] = []


def choose(dtype: torch.dtype, device: torch.device, kernel: str = "auto") -> str | None:
    """Which packed linears run this dtype on this device: "cpp" (the
    weight-streaming kernel of kernels/cpu_linear.py) where it builds and runs
    the dtype, else "onednn" where oneDNN runs it, else None (plain matmuls).
    kernel="cpp" or "onednn" asks for one (None where it cannot run)."""
    if kernel not in ("auto", *KERNELS):
        raise ValueError(f"kernel must be auto, cpp or onednn, not {kernel!r}")
    if device.type != "cpu":
        return None
    if kernel in ("auto", "cpp"):
        if dtype in cpu_linear.dtypes():
            return "cpp"
        if cpu_linear.build_error() and not _warned:
            _warned.append(cpu_linear.build_error())
            warnings.warn(f"CPU linears run on oneDNN: {cpu_linear.build_error()}", RuntimeWarning, stacklevel=2)
        if kernel == "cpp":
            return None
    return "onednn" if supported(dtype, device) else None


class PackedWeights:
    """Packed copies of a model's weights for one kernel ("cpp" or "onednn",
    see choose), each made on first use and made again when its weight
    changes: replaced, or written in place (which moves its version counter).
    A write through .data moves no counter and is not seen: pack again
    (Transformer.prepack) after one.

    Both give a row the same bits however many rows share the call (oneDNN
    through calls of ROWS rows), but not the same bits as each other: one
    model runs one of them for all its linears."""

    def __init__(self, kernel: str = "onednn") -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, not {kernel!r}")
        self.kernel = kernel
        self._pack = cpu_linear.pack if kernel == "cpp" else pack
        self._copies: dict[int, tuple[torch.Tensor, int, object]] = {}

    @property
    def min_rows(self) -> int:
        """The fewest rows a forward should run (linear pads what it needs itself)."""
        return 1

    def get(self, weight: torch.Tensor):
        entry = self._copies.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1] != weight._version:
            entry = (weight, weight._version, self._pack(weight))
            self._copies[id(weight)] = entry
        return entry[2]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, in] @ weight (+ bias) for weight stored [in, out], on its packed copy."""
        if self.kernel == "cpp":
            return cpu_linear.linear(x, self.get(weight), bias)
        rows, packed = x.shape[0], self.get(weight)
        x = F.pad(x, (0, 0, 0, -rows % ROWS))
        if x.shape[0] == ROWS:
            return packed_linear(x, packed, bias)[:rows]
        return torch.cat([packed_linear(chunk, packed, bias) for chunk in x.split(ROWS)])[:rows]
