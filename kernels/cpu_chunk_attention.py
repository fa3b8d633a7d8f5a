"""CPU attention of prompt chunks over the paged KV pool, read in place.

The kernel (kernels/cpu_chunk_attention.cpp) is flash attention with
register-tiled matmuls: work items of 96 rows (query, group head) of one KV
head, tiles of 64 logical key positions read from their pages, the scores
transposed so that each row's online softmax is one vector lane. It takes
the sequences whose queries in a step exceed what the decode kernel
(kernels/cpu_paged_attention.py) takes: prompt chunks and turn deltas.

A row's result depends on its own keys only (not on the rows it is tiled
with, the batch, or where its pages lie), so a chunk's logits are the same
in any step. The extension is compiled on first use (kernels/cpu_extension.py).
"""
from __future__ import annotations

from pathlib import Path

import torch

from agentkv.kernels import cpu_extension
from agentkv.kernels.cpu_paged_attention import require_supported, supports  # noqa: F401 (the decode kernel's shapes, for callers)
from agentkv.kernels.metadata import AttnMetadata

SOURCE = Path(__file__).with_suffix(".cpp")
extension = cpu_extension.Extension(
    "agentkv_cpu_chunk_attention", SOURCE, "agentkv_cpu_chunk",
    lambda library: getattr(torch.ops, library).chunk_attention,
    headers=[cpu_extension.ATTENTION_HEADER, cpu_extension.AMX_HEADER],
)
build_error, available = extension.build_error, extension.available


def chunk_attention_into(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
    sliding_window: int = 0,
    longer_than: int = 0,
) -> None:
    """reference.paged_attention_into's contract: out's rows of the sequences
    with more than longer_than queries (another kernel does the rest). q and
    out may have any token and head strides."""
    require_supported(q, k_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    extension.load()(
        q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale, sliding_window, longer_than, out,
    )
