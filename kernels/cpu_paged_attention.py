"""CPU paged attention for decode and verify steps, reading the KV pool in place.

The kernel (kernels/cpu_paged_attention.cpp) runs flash-decoding over each
sequence's pages: parallel over (sequence, KV head, key split), an online
softmax per row, all query heads of a KV head (and all k+1 queries of a
verify) sharing each read of a K/V page, so a step reads its K/V once with no
gather. Sequences with more than MAX_QUERIES queries in the step (prefill
chunks, which are compute- rather than read-bound) go to another kernel
(kernels/cpu_chunk_attention.py, or the torch reference).

The extension is compiled on first use (kernels/cpu_extension.py); a machine
without a C++ compiler or ninja raises CpuKernelUnavailable here, and
kernels.paged_attention falls back to the torch reference.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from kernels import cpu_extension, reference
from kernels.cpu_extension import CpuKernelUnavailable  # noqa: F401 (what extension.load() raises, for callers)
from kernels.metadata import AttnMetadata

SOURCE = Path(__file__).with_suffix(".cpp")

# Sequences with at most this many queries in a step run here: decode (1) and
# verify (k+1) steps; longer ones go to the reference. A query's result here
# does not depend on how many queries its sequence has in the step, while the
# reference's does, so every verify a drafter makes (up to 16 drafts, plus
# grammar-forced ones) runs here: a token's logits are then the same bits
# whether it was decoded or verified, and speculation cannot flip a greedy
# near-tie. That costs bf16 verify steps some speed: the kernel's work grows
# with the queries per K/V read while oneDNN's GEMMs do not (at 8k keys,
# SmolLM2's heads, one thread: fp32 still won at 16 queries, 208 vs 269 ms for
# 30 layers; bf16 won at 4, 63 vs 98 ms, and lost at 9, 112 vs 92 ms:
# docs/bench_cpu_attention.md).
MAX_QUERIES = {torch.float32: 32, torch.bfloat16: 32}

# Keys per work item. Fixed in logical positions, not chosen from the batch,
# so that a sequence's output bits do not depend on what shares its step; 512
# gives two busy cores enough items at 4k keys with 3 KV heads.
SPLIT = 512

DTYPES = (torch.float32, torch.bfloat16)

extension = cpu_extension.Extension(
    "agentkv_cpu_attention", SOURCE, lambda: torch.ops.agentkv_cpu.paged_attention_few, headers=[cpu_extension.ATTENTION_HEADER]
)
build_error, available = extension.build_error, extension.available


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """CPU fp32/bf16, head_dim a multiple of 16 up to 128 (whole vectors of 16
    lanes), contiguous within a head."""
    head_dim = q.shape[-1]
    return (
        q.device.type == "cpu" and q.dtype in DTYPES and k_cache.dtype == q.dtype
        and head_dim % 16 == 0 and head_dim <= 128 and k_cache.stride(3) == 1
    )


def require_supported(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """ValueError unless supports(q, k_cache) (the chunk kernel's shapes too:
    both read kernels/cpu_attention.h's vectors)."""
    if not supports(q, k_cache):
        raise ValueError(
            f"CPU {DTYPES} tensors with a contiguous head_dim of 16, 32, ..., 128 only, not "
            f"{q.device} {q.dtype} head_dim {q.shape[-1]}"
        )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
    sliding_window: int = 0,
    out: torch.Tensor | None = None,
    chunks: Callable = reference.paged_attention_into,
) -> torch.Tensor:
    """reference.paged_attention's result: decode/verify sequences here, the
    longer chunks of a mixed step by `chunks` (reference.paged_attention_into's
    signature: kernels/cpu_chunk_attention.py's where it builds). q and out
    (shaped like q; a new tensor when None) may have any token and head
    strides: a forward passes q as its slice of the qkv projection and out as
    rows of the buffer the output projection reads, so neither is copied."""
    require_supported(q, k_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    limit = MAX_QUERIES[q.dtype]
    if meta.min_query_len <= limit:
        extension.load()(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
            scale, sliding_window, limit, SPLIT, out,
        )
    if meta.max_query_len > limit:
        chunks(out, q, k_cache, v_cache, meta, scale, sliding_window, longer_than=limit)
    return out
