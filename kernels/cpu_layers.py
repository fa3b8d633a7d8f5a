"""A CPU forward's whole layer loop in one C++ call (kernels/cpu_layers.cpp).

It runs the ops the Python loop of model/llama.py runs, in its order, by
calling the other C++ extensions' registered ops (kernels/cpu_linear.py,
kernels/cpu_fused_ops.py, kernels/cpu_paged_attention.py), so the logits are
the Python loop's bits; only the Python between the ops goes. It runs where
all of those run a step: CPU fp32/bf16, the C++ linears, the fused ops and
the C++ attention, and every sequence of the step within that attention's
MAX_QUERIES (a longer prefill chunk needs the reference attention, which the
Python loop keeps).

Prepared once per (packed weights, page pool) by make: the embedding table,
the layers' norms, packed linears, biases and K/V page views are handed over
then; a step passes its token ids and metadata (forward), and the loop looks
the ids up itself.

The extension is compiled on first use (kernels/cpu_extension.py); without a
compiler, CpuKernelUnavailable, and kernels.dispatch.select keeps the Python loop
(one warning).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from agentkv.kernels import cpu_extension, cpu_fused_ops, cpu_paged_attention
from agentkv.kernels.cpu_linear import PackedLinear
from agentkv.kernels.metadata import AttnMetadata

SOURCE = Path(__file__).with_suffix(".cpp")

extension = cpu_extension.Extension(
    "agentkv_cpu_layers", SOURCE, "agentkv_cpu_layers", lambda library: getattr(torch.classes, library).Layers
)
build_error, available = extension.build_error, extension.available


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights as the loop takes them: norms as stored,
    linears packed (kernels/cpu_linear.pack), biases or None."""

    attn_norm: torch.Tensor
    qkv: PackedLinear
    qkv_bias: torch.Tensor | None
    o: PackedLinear
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate_up: PackedLinear
    gate_up_bias: torch.Tensor | None
    down: PackedLinear
    down_bias: torch.Tensor | None
    window: int  # sliding window, 0 for none
    q_norm: torch.Tensor | None = None  # Qwen3's per-head q and k norms [head_dim], or None
    k_norm: torch.Tensor | None = None


def make(
    layers: list[LayerWeights],
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    embed: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    final_norm: torch.Tensor,
    lm_head: PackedLinear,
) -> torch.ScriptObject:
    """The loop over layers with caches[i] = layer i's (K pages, V pages)
    [P, page_size, Hkv, D], after a lookup in embed [vocab, hidden]; the
    attention's scale is head_dim ** -0.5, as model/llama.py's. Raises ValueError (or RuntimeError where another
    extension's op is missing or changed) before anything is kept."""
    if len(layers) != len(caches) or not layers:
        raise ValueError(f"one (K, V) pair per layer: {len(layers)} layers, {len(caches)} caches")
    loop = extension.load()(
        num_heads, num_kv_heads, head_dim, eps, head_dim**-0.5, embed, cos, sin, final_norm, lm_head.data,
        lm_head.out_features, cpu_fused_ops.VECTOR_BYTES,
    )
    for w, (k_cache, v_cache) in zip(layers, caches):
        loop.add_layer(
            w.attn_norm, w.qkv.data, w.qkv_bias, w.o.data, w.o_bias, w.mlp_norm, w.gate_up.data, w.gate_up_bias,
            w.down.data, w.down_bias, w.down.in_features, k_cache, v_cache, w.window, w.q_norm, w.k_norm,
        )
    return loop


def runs(meta: AttnMetadata, dtype: torch.dtype) -> bool:
    """Whether every sequence of the step is within the C++ attention's limit."""
    return meta.max_query_len <= cpu_paged_attention.MAX_QUERIES[dtype]


def forward(
    loop: torch.ScriptObject, ids: torch.Tensor, o_rows: torch.Tensor, meta: AttnMetadata,
    logit_indices: torch.Tensor | None,
) -> torch.Tensor:
    """fp32 logits at the integer logit_indices (at all meta.num_tokens tokens when None)
    of the step whose token ids are ids [R] (T tokens, then ids run as padding
    rows); o_rows: the [R, heads * head_dim] rows the attention writes
    (model/llama.py's ForwardScratch.attention_rows). Needs runs(meta, dtype)."""
    return loop.forward(
        ids, o_rows, meta.positions, meta.slot_mapping, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
        logit_indices, cpu_paged_attention.MAX_QUERIES[o_rows.dtype], cpu_paged_attention.SPLIT,
        cpu_paged_attention.prefetch_tiles(),
    )
