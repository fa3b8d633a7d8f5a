"""Triton copy_pages against the torch reference: a bitwise copy, so every
dtype runs under the interpreter too."""
from __future__ import annotations

import pytest
import torch

from agentkv.kernels import reference
from agentkv.kernels.triton_copy_pages import copy_pages

# (layers, pages, page_size, kv heads, head_dim, copies); the last page is
# 32 * 4 * 64 elements, more than one program's block.
SHAPES = [(2, 9, 4, 2, 16, 3), (3, 12, 16, 1, 24, 5), (2, 6, 32, 4, 64, 2)]


@pytest.mark.parametrize("head_major", [True, False], ids=["pool-layout", "page-contiguous"])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=["p4-d16", "p16-d24", "p32-d64"])
def test_matches_reference(shape, dtype, index_dtype, head_major, device):
    layers, pages, page_size, kv_heads, head_dim, copies = shape
    g = torch.Generator().manual_seed(0)
    if head_major:  # as cache.pool.PagePool stores it
        kv = torch.randn(layers, 2, kv_heads, pages, page_size, head_dim, generator=g).to(device, dtype)
        kv = kv.permute(0, 1, 3, 4, 2, 5)
    else:
        kv = torch.randn(layers, 2, pages, page_size, kv_heads, head_dim, generator=g).to(device, dtype)
    perm = torch.randperm(pages, generator=g)
    src, dst = perm[:copies].to(device, index_dtype), perm[copies : 2 * copies].to(device, index_dtype)
    expected = kv.clone()
    reference.copy_pages(expected, src, dst)
    copy_pages(kv, src, dst)
    assert torch.equal(kv, expected)


def test_no_copies_is_a_no_op(device):
    kv = torch.randn(1, 2, 3, 4, 1, 16, device=device)
    before = kv.clone()
    empty = torch.empty(0, dtype=torch.int64, device=device)
    copy_pages(kv, empty, empty)
    assert torch.equal(kv, before)


def test_rejects_a_strided_last_dim(device):
    kv = torch.randn(1, 2, 3, 16, 4, 1, device=device).transpose(3, 5)  # [1, 2, 3, 1, 4, 16] strided
    idx = torch.tensor([0], device=device)
    with pytest.raises(ValueError):
        copy_pages(kv, idx, idx + 1)
