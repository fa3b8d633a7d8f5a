"""CPU paged attention for decode and verify steps, reading the KV pool in place.

The kernel (kernels/cpu_paged_attention.cpp) runs flash-decoding over each
sequence's pages: parallel over (sequence, KV head, key split), an online
softmax per row, all query heads of a KV head (and all k+1 queries of a
verify) sharing each read of a K/V page, so a step reads its K/V once with no
gather. Sequences with more than MAX_QUERIES queries in the step (prefill
chunks, which are compute- rather than read-bound) go to another kernel
(kernels/cpu_chunk_attention.py, or the torch reference). How far ahead it
prefetches K/V by software, if at all, is timed on the first pool a process
runs (tune_prefetch): which is faster depends on the host.

The extension is compiled on first use (kernels/cpu_extension.py); a machine
without a C++ compiler or ninja raises CpuKernelUnavailable here, and
kernels.dispatch.paged_attention falls back to the torch reference.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from agentkv.kernels import cpu_extension, reference
from agentkv.kernels.cpu_extension import CpuKernelUnavailable  # noqa: F401 (what extension.load() raises, for callers)
from agentkv.kernels.metadata import AttnMetadata

SOURCE = Path(__file__).with_suffix(".cpp")

# Sequences with at most this many queries in a step run here: decode (1) and
# verify (k+1) steps; longer ones go to the reference. A query's result here
# does not depend on how many queries its sequence has in the step, while the
# reference's does, so every verify a drafter makes (up to 16 drafts, plus
# grammar-forced ones) runs here: a token's logits are then the same bits
# whether it was decoded or verified, and speculation cannot flip a greedy
# near-tie. That costs bf16 verify steps some speed: the kernel's work grows
# with the queries per K/V read while oneDNN's GEMMs do not (at 8k keys fp32
# still won at 16 queries; bf16 won at 4 and lost at 9:
# docs/bench_cpu_attention.md).
MAX_QUERIES = {torch.float32: 32, torch.bfloat16: 32}

# Keys per work item. Fixed in logical positions, not chosen from the batch,
# so that a sequence's output bits do not depend on what shares its step; 512
# gives two busy cores enough items at 4k keys with 3 KV heads.
SPLIT = 512

DTYPES = (torch.float32, torch.bfloat16)

extension = cpu_extension.Extension(
    "agentkv_cpu_attention", SOURCE, "agentkv_cpu", lambda library: getattr(torch.ops, library).paged_attention_few,
    headers=[cpu_extension.ATTENTION_HEADER],
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


# Tiles of keys (one vector of them: 16 on AVX-512 builds, 8 on AVX2 ones) the
# kernel reads ahead by software prefetch, 0 for none.
# Which is faster depends on the host, not on the CPU model: on one Zen 4
# host the kernel read its K/V faster with prefetches two tiles ahead
# (docs/bench_cpu_attention.md, round 4); on another, the hardware
# prefetchers alone were faster (round 6). So a process times both on the
# first pool it runs (tune_prefetch) unless PREFETCH_ENV fixes the choice.
# Results are the same bits either way.
PREFETCH_CHOICES = (0, 2)
PREFETCH_ENV = "AGENTKV_CPU_PREFETCH"
MAX_PREFETCH = 16  # the kernel's kMaxPrefetchTiles
# K/V timed per choice: a few times the last-level cache of a server CPU, so
# that the reads come from memory, as a long context's do.
TUNE_BYTES = 128 << 20


@dataclass(frozen=True)
class PrefetchTuning:
    """What tune_prefetch chose, and from what: ms per choice (median of
    repeats over `keys` keys of every timed layer), or empty where the
    environment fixed it."""

    tiles: int
    ms: dict[int, float]
    keys: int
    layers: int
    threads: int


_tuning = PrefetchTuning(2, {}, 0, 0, 0)  # until a pool is tuned: round 4's choice
_tuned_pool: tuple = ()  # what _tuning was measured on


def prefetch_tiles() -> int:
    """The prefetch distance every call of the kernel takes now."""
    return _tuning.tiles


def tuning() -> PrefetchTuning:
    """The last tune_prefetch's choice and timings (for reports)."""
    return _tuning


def configured_prefetch() -> int | None:
    """PREFETCH_ENV's tiles (0..MAX_PREFETCH), None when unset or "auto";
    ValueError for anything else."""
    raw = os.environ.get(PREFETCH_ENV, "auto").strip()
    if raw == "auto":
        return None
    if not raw.isdigit() or int(raw) > MAX_PREFETCH:
        raise ValueError(f"{PREFETCH_ENV} must be 'auto' or a number of tiles 0..{MAX_PREFETCH}, not {raw!r}")
    return int(raw)


def tune_prefetch(
    caches: list[tuple[torch.Tensor, torch.Tensor]], num_heads: int, budget_bytes: int = TUNE_BYTES, repeats: int = 5
) -> PrefetchTuning:
    """Choose the prefetch distance of every later call: PREFETCH_ENV's, or
    the PREFETCH_CHOICES entry fastest over caches (layer i's K and V pages
    [P, page_size, Hkv, D], as the pool holds them: its placement decides as
    much as the host), read by one decode query of num_heads heads per layer
    over up to budget_bytes of pages, alternately, median of repeats; once
    per pool and thread count (asked again, the choice stands). The pages'
    contents are only read. Raises CpuKernelUnavailable where the kernel does
    not build."""
    global _tuning, _tuned_pool
    fixed = configured_prefetch()
    threads = torch.get_num_threads()
    if fixed is not None:
        _tuning, _tuned_pool = PrefetchTuning(fixed, {}, 0, 0, threads), ()
        return _tuning
    k0, v0 = caches[0]
    pool = (k0.data_ptr(), tuple(k0.shape), k0.dtype, len(caches), threads, budget_bytes)
    if pool == _tuned_pool:
        return _tuning
    op = extension.load()
    # A generator of its own: the global one's state is the caller's (sampling seeds).
    q = torch.randn(1, num_heads, k0.shape[-1], generator=torch.Generator().manual_seed(0)).to(k0.dtype)
    require_supported(q, k0)
    pages, page_size = k0.shape[0], k0.shape[1]
    page_bytes = (k0[0].numel() + v0[0].numel()) * k0.element_size()
    layers = max(1, min(len(caches), budget_bytes // (page_bytes * pages)))
    pages = max(1, min(pages, budget_bytes // (page_bytes * layers)))
    keys = pages * page_size
    meta = AttnMetadata.build([1], [keys], [list(range(pages))], page_size)
    out = torch.empty_like(q)
    scale = k0.shape[-1] ** -0.5

    def timed(tiles: int) -> float:
        t = time.perf_counter()
        for k, v in caches[:layers]:
            op(q, k, v, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale, 0, 1, SPLIT, tiles, out)
        return time.perf_counter() - t

    times: dict[int, list[float]] = {c: [] for c in PREFETCH_CHOICES}
    for c in PREFETCH_CHOICES:
        timed(c)  # warm-up
    for _ in range(repeats):
        for c in PREFETCH_CHOICES:
            times[c].append(timed(c))
    ms = {c: statistics.median(t) * 1e3 for c, t in times.items()}
    _tuning, _tuned_pool = PrefetchTuning(min(ms, key=ms.get), ms, keys, layers, threads), pool
    return _tuning

def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
    sliding_window: int = 0,
    out: torch.Tensor | None = None,
    chunks: Callable = reference.paged_attention_into,
    prefetch: int | None = None,
) -> torch.Tensor:
    """reference.paged_attention's result: decode/verify sequences here, the
    longer chunks of a mixed step by `chunks` (reference.paged_attention_into's
    signature: kernels/cpu_chunk_attention.py's where it builds). q and out
    (shaped like q; a new tensor when None) may have any token and head
    strides: a forward passes q as its slice of the qkv projection and out as
    rows of the buffer the output projection reads, so neither is copied.
    prefetch: the kernel's prefetch distance in tiles (the tuned one,
    prefetch_tiles(), when None)."""
    require_supported(q, k_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    limit = MAX_QUERIES[q.dtype]
    if meta.min_query_len <= limit:
        extension.load()(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
            scale, sliding_window, limit, SPLIT, prefetch_tiles() if prefetch is None else prefetch, out,
        )
    if meta.max_query_len > limit:
        chunks(out, q, k_cache, v_cache, meta, scale, sliding_window, longer_than=limit)
    return out
