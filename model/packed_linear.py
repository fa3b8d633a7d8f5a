"""Packed CPU linears: the weight-streaming C++ kernel (kernels/cpu_linear.py)
where it runs, else oneDNN with weights packed once into its blocked layout.

With oneDNN: its plain bf16 matmul is slow for thin inputs, and both
dtypes gain on a few rows from packing. Engine, SmolLM2 shape, one thread, 2k context:
bf16 decode step 63.7 -> 52.1 ms, 8-token verify 94.8 -> 65.9 ms; fp32
8-token verify 134-160 -> 87-89 ms; prefill about even. The packed kernels
also give each row the same result however many rows share the call, from
two rows up (PackedWeights.linear pads fewer), which plain matmuls on CPU do
not.

The C++ kernel reads the weights of a decode step at close to memory
bandwidth where oneDNN reaches about 60% of it, and matches oneDNN on prefill
chunks (docs/bench_cpu_linear.md), so where it builds it runs every linear.
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


# oneDNN's packed kernels give a row the same bits however many rows share
# the call from two up, but one row takes another kernel, whose fp32 sums
# differ from 1536 inputs on. Fewer rows than this are padded to it (with
# zeros, dropped after): any count from two keeps the bits, and four ran
# fastest. SmolLM2 shape, one thread, a decode step at 2k context in fp32:
# one row as is 58.6 ms, padded to 2 rows 68.9, to 4 51.7, to 8 61.7, the
# plain matmul 49.4; two decodes 78.5 ms as is, 62.8 padded; in bf16 one
# decode 40.4 ms as is, 38.4 padded.
MIN_ROWS = 4

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
    from MIN_ROWS rows up: linear pads fewer), but not the same bits as each
    other: one model runs one of them for all its linears."""

    def __init__(self, kernel: str = "onednn") -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, not {kernel!r}")
        self.kernel = kernel
        self._pack = cpu_linear.pack if kernel == "cpp" else pack
        self._copies: dict[int, tuple[torch.Tensor, int, object]] = {}

    @property
    def min_rows(self) -> int:
        """The fewest rows linear runs without padding them."""
        return 1 if self.kernel == "cpp" else MIN_ROWS

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
        rows = x.shape[0]
        if rows < MIN_ROWS:
            x = F.pad(x, (0, 0, 0, MIN_ROWS - rows))
            return packed_linear(x, self.get(weight), bias)[:rows]
        return packed_linear(x, self.get(weight), bias)
