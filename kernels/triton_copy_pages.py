"""Copy whole KV pages inside the pool, every layer, K and V, in one launch
(copy-on-write of a shared, partially filled page).

Maths: kv[l, c, dst[i]] = kv[l, c, src[i]] for every layer l, c in {K, V} and
copy i. The copy is bitwise: elements move as integers of their width, so
any dtype (and any NaN payload) round-trips.

Layout: kv [L, 2, P, page_size, Hkv, D] with any strides but a contiguous
last dim (the pool stores it head-major). Program (i, (l * 2 + c) * Hkv + h,
chunk) copies BLOCK elements of head h's [page_size, D] part of the page.
dst pages must be distinct and disjoint from src pages (copy-on-write copies
into fresh pages): the copies run concurrently.

Tested with triton 3.9 (interpreter); written for triton 3.6 on an H200,
where profiling/gpu_check.py runs the same tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_BLOCK = 4096


@triton.jit
def _copy_pages_kernel(
    kv_ptr,  # [L, 2, P, PAGE_SIZE, H, HEAD_DIM] as integers of the element width, any strides
    src_ptr,  # [N]
    dst_ptr,  # [N]
    stride_kv_layer,
    stride_kv_kind,
    stride_kv_page,
    stride_kv_slot,
    stride_kv_head,
    NUM_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    copy = tl.program_id(0).to(tl.int64)
    lkh = tl.program_id(1).to(tl.int64)  # (layer, kind, head) flattened
    chunk = tl.program_id(2).to(tl.int64)
    head = lkh % NUM_HEADS
    layer_kind = lkh // NUM_HEADS
    base = kv_ptr + (layer_kind // 2) * stride_kv_layer + (layer_kind % 2) * stride_kv_kind + head * stride_kv_head
    src = tl.load(src_ptr + copy).to(tl.int64)
    dst = tl.load(dst_ptr + copy).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)  # over one head's [PAGE_SIZE, HEAD_DIM] of a page
    mask = offs < PAGE_SIZE * HEAD_DIM
    within = (offs // HEAD_DIM) * stride_kv_slot + offs % HEAD_DIM
    data = tl.load(base + src * stride_kv_page + within, mask=mask)
    tl.store(base + dst * stride_kv_page + within, data, mask=mask)


def copy_pages(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Triton copy_pages with the contract of kernels.reference.copy_pages."""
    if kv.dim() != 6 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [L, 2, P, page_size, Hkv, D], got {tuple(kv.shape)}")
    if src.shape != dst.shape or src.dim() != 1 or src.device != kv.device or dst.device != kv.device:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must be 1-D, of one length, on kv's device")
    num_layers, _, _, page_size, num_kv_heads, head_dim = kv.shape
    if kv.stride(5) != 1:
        raise ValueError(f"kv must be contiguous in its last dim, got strides {kv.stride()}")
    if src.numel() == 0:
        return
    bits = kv.view(_INT_OF_WIDTH[kv.element_size()])
    page_numel = page_size * head_dim
    block = min(triton.next_power_of_2(page_numel), _MAX_BLOCK)
    grid = (src.numel(), num_layers * 2 * num_kv_heads, triton.cdiv(page_numel, block))
    _copy_pages_kernel[grid](
        kv_ptr=bits,
        src_ptr=src,
        dst_ptr=dst,
        stride_kv_layer=bits.stride(0),
        stride_kv_kind=bits.stride(1),
        stride_kv_page=bits.stride(2),
        stride_kv_slot=bits.stride(3),
        stride_kv_head=bits.stride(4),
        NUM_HEADS=num_kv_heads,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK=block,
    )
