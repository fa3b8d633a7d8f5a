"""Rotary embedding of q and k fused with the KV-cache write, one pass.

Maths (HF "rotate_half" convention), for each new token t at position
p = positions[t], each head, and i < D/2 with c = cos[p, i], s = sin[p, i]:

    x'[i]       = x[i] c - x[i + D/2] s
    x'[i + D/2] = x[i + D/2] c + x[i] s

in fp32, rounded to the input dtype. Rotated q is returned; rotated k and v
are written to cache slot slot_mapping[t] (page slot // PAGE_SIZE, offset
slot % PAGE_SIZE).

With q_norm and k_norm (Qwen3's per-head norms, [D] each) every head of q
and k is first RMS-normalized, x = w * round(x / sqrt(mean(x^2) + eps)),
with reference.rmsnorm's roundings, in the same pass.

Layouts:
  q [T, Hq, D], k and v [T, Hkv, D]       any strides (views of a fused qkv)
  cos, sin [max_pos, D // 2]              fp32
  q_norm, k_norm [D]                      q's dtype, contiguous
  k_cache, v_cache [P, PAGE_SIZE, Hkv, D] any strides
One program per token handles all its heads.

Tested with triton 3.9 (interpreter, fp32); written for triton 3.6 on an H200,
where profiling/gpu_check.py runs the same tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentkv.kernels.metadata import AttnMetadata


@triton.jit
def _rotate(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _head_rmsnorm(x1, x2, w_ptr, offs_i, i_valid, eps, out_ptr, HALF: tl.constexpr):
    """Each row (a head) of halves x1, x2 (fp32, masked lanes 0) RMS-normalized
    and scaled by w, rounded as reference.rmsnorm rounds: the normalized
    value to the input dtype, then its product with w."""
    dtype = out_ptr.dtype.element_ty
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(w_ptr + offs_i, mask=i_valid, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + offs_i, mask=i_valid, other=0.0).to(tl.float32)[None, :]
    y1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    y2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return y1, y2


@triton.jit
def _rope_and_store_kernel(
    q_out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    cos_ptr,  # [max_pos, D // 2] fp32
    sin_ptr,  # [max_pos, D // 2] fp32
    k_cache_ptr,  # [P, PAGE_SIZE, Hkv, D]
    v_cache_ptr,  # [P, PAGE_SIZE, Hkv, D]
    positions_ptr,  # [T] int64
    slot_mapping_ptr,  # [T] int64
    q_norm_ptr,  # [D], read only with QK_NORM
    k_norm_ptr,  # [D], read only with QK_NORM
    eps,
    stride_qo_tok,
    stride_qo_head,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cos_pos,
    stride_sin_pos,
    stride_kc_page,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_page,
    stride_vc_slot,
    stride_vc_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok)
    slot = tl.load(slot_mapping_ptr + tok)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE

    offs_i = tl.arange(0, HALF_PAD)
    i_valid = offs_i < HALF
    cos = tl.load(cos_ptr + pos * stride_cos_pos + offs_i, mask=i_valid, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin_pos + offs_i, mask=i_valid, other=0.0)[None, :]

    offs_hq = tl.arange(0, Q_HEADS_PAD)
    q_mask = (offs_hq < NUM_Q_HEADS)[:, None] & i_valid[None, :]
    q_lo = q_ptr + tok * stride_q_tok + offs_hq[:, None] * stride_q_head + offs_i[None, :]
    q1 = tl.load(q_lo, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_lo + HALF, mask=q_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        q1, q2 = _head_rmsnorm(q1, q2, q_norm_ptr, offs_i, i_valid, eps, q_out_ptr, HALF)
    q1, q2 = _rotate(q1, q2, cos, sin)
    qo_lo = q_out_ptr + tok * stride_qo_tok + offs_hq[:, None] * stride_qo_head + offs_i[None, :]
    tl.store(qo_lo, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(qo_lo + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)

    offs_hk = tl.arange(0, KV_HEADS_PAD)
    kv_mask = (offs_hk < NUM_KV_HEADS)[:, None] & i_valid[None, :]
    k_lo = k_ptr + tok * stride_k_tok + offs_hk[:, None] * stride_k_head + offs_i[None, :]
    k1 = tl.load(k_lo, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_lo + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        k1, k2 = _head_rmsnorm(k1, k2, k_norm_ptr, offs_i, i_valid, eps, k_cache_ptr, HALF)
    k1, k2 = _rotate(k1, k2, cos, sin)
    kc_lo = k_cache_ptr + page * stride_kc_page + offset * stride_kc_slot + offs_hk[:, None] * stride_kc_head + offs_i[None, :]
    tl.store(kc_lo, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(kc_lo + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)

    # v moves untouched, in two halves like k so one mask serves both.
    v_lo = v_ptr + tok * stride_v_tok + offs_hk[:, None] * stride_v_head + offs_i[None, :]
    vc_lo = v_cache_ptr + page * stride_vc_page + offset * stride_vc_slot + offs_hk[:, None] * stride_vc_head + offs_i[None, :]
    tl.store(vc_lo, tl.load(v_lo, mask=kv_mask, other=0.0), mask=kv_mask)
    tl.store(vc_lo + HALF, tl.load(v_lo + HALF, mask=kv_mask, other=0.0), mask=kv_mask)


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """Triton rope_and_store with the contract of kernels.reference.rope_and_store."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    half = head_dim // 2
    if head_dim % 2 or k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree or D is odd")
    if k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape or page_size != meta.page_size:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if cos.shape != sin.shape or cos.shape[1] != half or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos/sin must be fp32 [max_pos, {half}], got {tuple(cos.shape)} {cos.dtype}")
    if not (q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k, v and the caches must share a dtype, got {q.dtype}, {k.dtype}, {k_cache.dtype}")
    if meta.positions.shape[0] != num_tokens or meta.slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"q has {num_tokens} tokens, the metadata {meta.positions.shape[0]}")
    _check_last_dim_contiguous(q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)
    qk_norm = q_norm is not None
    if qk_norm and not (k_norm is not None and q_norm.shape == k_norm.shape == (head_dim,) and q_norm.is_contiguous()
                        and k_norm.is_contiguous() and q_norm.dtype == k_norm.dtype == q.dtype):
        raise ValueError(f"q_norm and k_norm must both be contiguous [{head_dim}] of q's dtype")

    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _rope_and_store_kernel[(num_tokens,)](
        q_out_ptr=q_out,
        q_ptr=q,
        k_ptr=k,
        v_ptr=v,
        cos_ptr=cos,
        sin_ptr=sin,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        positions_ptr=meta.positions,
        slot_mapping_ptr=meta.slot_mapping,
        q_norm_ptr=q_norm if qk_norm else q,  # unread without QK_NORM
        k_norm_ptr=k_norm if qk_norm else q,
        eps=float(eps),
        stride_qo_tok=q_out.stride(0),
        stride_qo_head=q_out.stride(1),
        stride_q_tok=q.stride(0),
        stride_q_head=q.stride(1),
        stride_k_tok=k.stride(0),
        stride_k_head=k.stride(1),
        stride_v_tok=v.stride(0),
        stride_v_head=v.stride(1),
        stride_cos_pos=cos.stride(0),
        stride_sin_pos=sin.stride(0),
        stride_kc_page=k_cache.stride(0),
        stride_kc_slot=k_cache.stride(1),
        stride_kc_head=k_cache.stride(2),
        stride_vc_page=v_cache.stride(0),
        stride_vc_slot=v_cache.stride(1),
        stride_vc_head=v_cache.stride(2),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        PAGE_SIZE=page_size,
        QK_NORM=qk_norm,
    )
    return q_out
