"""Triton paged attention against the torch reference on ragged mixed batches."""
from __future__ import annotations

import pytest
import torch

from agentkv.kernels import reference
from agentkv.kernels.metadata import AttnMetadata
from agentkv.kernels.triton_paged_attention import _num_splits, _tile_sizes, paged_attention

# (id, page_size, (q heads, kv heads), head_dim, [(query_len, cached_len)], sliding_window)
# Each batch mixes decode (Δ=1), empty caches, caches shorter than a page, chunks
# that start mid-page and cross page boundaries, and partially filled last pages.
CASES = [
    ("p4-mha-d16", 4, (2, 2), 16, [(1, 0), (3, 2), (5, 7), (1, 13), (6, 0)], 0),
    ("p16-gqa4-d64", 16, (8, 2), 64, [(1, 40), (7, 9), (20, 3), (1, 0), (1, 15)], 0),
    ("p32-gqa8-d128", 32, (8, 1), 128, [(1, 70), (9, 30), (33, 0), (2, 31)], 0),
    ("p8-gqa4-d24", 8, (8, 2), 24, [(1, 21), (11, 5), (4, 0)], 0),
    ("p16-gqa5-d80", 16, (10, 2), 80, [(1, 50), (6, 10), (17, 1)], 0),
    ("p4-gqa4-d24-window5", 4, (4, 1), 24, [(1, 30), (9, 6), (12, 0)], 5),
    ("p16-gqa8-d64-window24", 16, (8, 1), 64, [(1, 100), (17, 40), (3, 2)], 24),
]
LOW_PRECISION_CASES = [CASES[1], CASES[2], CASES[4], CASES[6]]

# Tolerances against the reference evaluated in fp32 on the same (rounded) inputs:
# fp32 is exact up to summation order; bf16/fp16 round P and the output.
FP32 = (torch.float32, 2e-5, 2e-5)
LOW_PRECISION = [(torch.bfloat16, 1.6e-2, 1.6e-2), (torch.float16, 4e-3, 4e-3)]


def _skip_on_cpu(device: str, dtype: torch.dtype) -> None:
    if device == "cpu" and dtype != torch.float32:
        pytest.skip("the Triton interpreter rounds bf16/fp16 stores differently from a GPU; checked on CUDA")


def make_batch(
    spec: list[tuple[int, int]],
    page_size: int,
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttnMetadata]:
    """Random q and a paged cache whose pages are a random permutation; slots no
    sequence owns hold NaN, so a kernel that reads past a sequence fails."""
    g = torch.Generator().manual_seed(seed)
    num_q_heads, num_kv_heads = heads
    query_lens = [q for q, _ in spec]
    seq_lens = [q + c for q, c in spec]
    pages_per_seq = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per_seq) + 3
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, start = [], 0
    for n in pages_per_seq:
        tables.append(perm[start : start + n])
        start += n
    meta = AttnMetadata.build(query_lens, seq_lens, tables, page_size, device=device)

    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for table, s_len in zip(tables, seq_lens):
        for pos in range(s_len):
            page, slot = table[pos // page_size], pos % page_size
            k_cache[page, slot] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
            v_cache[page, slot] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
    # q is a strided view into a fused qkv buffer, as the model produces it.
    tokens = sum(query_lens)
    qkv = torch.randn(tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    q = qkv.to(device)[:, :num_q_heads]
    return q, k_cache.to(device), v_cache.to(device), meta


def check(case, dtype_tol, num_splits: int | None, device: str) -> None:
    _, page_size, heads, head_dim, spec, window = case
    dtype, atol, rtol = dtype_tol
    _skip_on_cpu(device, dtype)
    q, k_cache, v_cache, meta = make_batch(spec, page_size, heads, head_dim, dtype, device)
    scale = head_dim**-0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale, window, num_splits=num_splits)
    expected = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale, window)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["single", "split3"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_fp32(case, num_splits, device):
    check(case, FP32, num_splits, device)


@pytest.mark.parametrize("num_splits", [1, 4], ids=["single", "split4"])
@pytest.mark.parametrize("dtype_tol", LOW_PRECISION, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=[c[0] for c in LOW_PRECISION_CASES])
def test_matches_reference_low_precision(case, dtype_tol, num_splits, device):
    check(case, dtype_tol, num_splits, device)


def test_more_splits_than_tiles(device):
    """Most splits of a short sequence are empty; the merge must ignore them."""
    check(("short", 4, (4, 2), 16, [(1, 2), (3, 0), (1, 9)], 0), FP32, 16, device)


@pytest.mark.parametrize("window", [0, 300])
def test_heuristic_splits_long_decode(window, device):
    """Few long decodes: the wrapper's heuristic picks split-K by itself."""
    spec = [(1, 1200), (2, 700)]
    assert _num_splits(num_programs=2, max_seq_len=1202) > 1
    check(("long-decode", 16, (4, 1), 32, spec, window), FP32, None, device)


def test_tile_sizes():
    """Prefill takes big unsplit tiles; decode the smallest tl.dot allows; fp32
    tiles stay small enough to pipeline in shared memory."""
    assert _num_splits(num_programs=4096, max_seq_len=32768) == 1
    assert _tile_sizes(group=4, max_query_len=1024, head_dim_pad=128, element_size=2) == (128, 64)
    assert _tile_sizes(group=4, max_query_len=1, head_dim_pad=128, element_size=2) == (16, 64)
    assert _tile_sizes(group=4, max_query_len=5, head_dim_pad=128, element_size=2) == (32, 64)
    assert _tile_sizes(group=4, max_query_len=1024, head_dim_pad=128, element_size=4) == (64, 32)


def test_rejects_mismatched_shapes(device):
    q, k_cache, v_cache, meta = make_batch([(2, 3)], 4, (4, 2), 16, torch.float32, device)
    with pytest.raises(ValueError):
        paged_attention(q[:, :3], k_cache, v_cache, meta, 0.25)
    with pytest.raises(ValueError):
        paged_attention(q[:1], k_cache, v_cache, meta, 0.25)
