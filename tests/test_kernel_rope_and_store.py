"""Triton rope_and_store against the torch reference."""
from __future__ import annotations

import pytest
import torch

from agentkv.kernels import reference
from agentkv.kernels.metadata import AttnMetadata
from agentkv.kernels.triton_rope_and_store import rope_and_store

# (id, page_size, (q heads, kv heads), head_dim, [(query_len, cached_len)])
CASES = [
    ("p4-d16", 4, (4, 2), 16, [(1, 0), (5, 2), (1, 9)]),
    ("p16-d64", 16, (8, 2), 64, [(7, 9), (1, 40), (3, 0)]),
    ("p32-d128", 32, (8, 1), 128, [(1, 70), (12, 30)]),
    ("p8-d24-heads6x3", 8, (6, 3), 24, [(11, 5), (1, 0), (2, 14)]),
]
# fp32 differs only where a GPU fuses the rotation into an FMA; bf16/fp16 by one rounding.
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1.6e-2, 1.6e-2), (torch.float16, 2e-3, 2e-3)]
MAX_POS = 128


def rope_tables(head_dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq)
    return freqs.cos().to(device), freqs.sin().to(device)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["", "qk-norm"])
@pytest.mark.parametrize("dtype_tol", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case, dtype_tol, qk_norm, device):
    """With qk_norm, Qwen3's per-head q and k norms, applied before the rotation."""
    _, page_size, (num_q_heads, num_kv_heads), head_dim, spec = case
    dtype, atol, rtol = dtype_tol
    if device == "cpu" and dtype != torch.float32:
        pytest.skip("the Triton interpreter rounds bf16/fp16 stores differently from a GPU; checked on CUDA")
    g = torch.Generator().manual_seed(0)
    seq_lens = [q + c for q, c in spec]
    pages_per_seq = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per_seq) + 2
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = [perm[sum(pages_per_seq[:i]) : sum(pages_per_seq[: i + 1])] for i in range(len(spec))]
    meta = AttnMetadata.build([q for q, _ in spec], seq_lens, tables, page_size, device=device)

    tokens = sum(q for q, _ in spec)
    qkv = torch.randn(tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=g).to(device, dtype)
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)  # strided views
    cos, sin = rope_tables(head_dim, device)
    cache_shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=g).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=g).to(device, dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    norms = [(torch.randn(head_dim, generator=g) * 0.5 + 1).to(device, dtype) for _ in range(2)] if qk_norm else []

    q_rot = rope_and_store(q, k, v, cos, sin, k_cache, v_cache, meta, *norms, eps=1e-6)
    q_expected = reference.rope_and_store(q, k, v, cos, sin, k_expected, v_expected, meta, *norms, eps=1e-6)

    assert q_rot.dtype == dtype and q_rot.shape == q.shape
    if qk_norm:  # the norms change q
        unnormed = reference.rope_and_store(q, k, v, cos, sin, k_expected.clone(), v_expected.clone(), meta)
        assert not torch.allclose(q_expected, unnormed, atol=0.1)
    torch.testing.assert_close(q_rot, q_expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_cache, k_expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(v_cache, v_expected, atol=0, rtol=0)


@pytest.mark.parametrize("head_dim, norm_sizes", [(5, ()), (4, (4, 3))], ids=["odd-head-dim", "norm-size"])
def test_rejects_bad_shapes(head_dim, norm_sizes, device):
    meta = AttnMetadata.build([1], [1], [[0]], 4, device=device)
    x = torch.zeros(1, 1, head_dim, device=device)
    cos = torch.zeros(4, 2, device=device)
    cache = torch.zeros(1, 4, 1, head_dim, device=device)
    norms = [torch.ones(n, device=device) for n in norm_sizes]
    with pytest.raises(ValueError):
        rope_and_store(x, x, x, cos, cos, cache, cache.clone(), meta, *norms, eps=1e-6)
