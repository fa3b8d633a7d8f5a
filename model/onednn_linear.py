"""Linear layers on CPU through oneDNN with weights packed once into its
blocked layout. oneDNN's plain bf16 matmul is slow for thin inputs, and both
dtypes gain on a few rows. Engine, SmolLM2 shape, one thread, 2k context:
bf16 decode step 63.7 -> 52.1 ms, 8-token verify 94.8 -> 65.9 ms; fp32
8-token verify 134-160 -> 87-89 ms; prefill about even. The packed kernels
also give each row the same result however many rows share the call, from
two rows up (model.llama.linear pads fewer), which plain matmuls on CPU do
not.
"""
from __future__ import annotations

import torch


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


class PackedWeights:
    """Packed copies of a model's weights, each made on first use and made
    again when its weight changes: replaced, or written in place (which moves
    its version counter). A write through .data moves no counter and is not
    seen: pack again (Transformer.prepack) after one."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        entry = self._copies.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1] != weight._version:
            entry = (weight, weight._version, pack(weight))
            self._copies[id(weight)] = entry
        return entry[2]
