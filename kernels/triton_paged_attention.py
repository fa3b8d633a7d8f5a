"""Paged attention over a ragged batch: prefill, chunked prefill, verify and decode
in one kernel (flash-attention online softmax, GQA, optional sliding window),
plus a split-K (flash-decoding) variant for long contexts with few programs.

Maths. Sequence i holds L_i = seq_lens[i] keys; its q_len_i new tokens sit at
positions p in [L_i - q_len_i, L_i) and their K/V are already in the pages.
For token t at position p and query head h (KV head g = h // G, G = Hq // Hkv):

    out[t, h] = sum_j softmax_j(scale * q[t, h] . k_j) v_j   over keys j of
                its sequence with j <= p (and j > p - sliding_window if > 0)

The softmax runs online over key tiles in base 2 (scale folded with log2 e):
m' = max(m, rowmax(s)), l' = l 2^(m - m') + rowsum(2^(s - m')),
acc' = acc 2^(m - m') + 2^(s - m') V. With split-K each of S programs covers
a contiguous share of the key tiles and stores (acc / l, lse = m + log2 l);
a merge kernel combines them as sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M).

Layouts:
  q, out         [T, Hq, D]                 any strides
  k_cache, v_cache [P, PAGE_SIZE, Hkv, D]   any strides; key j of sequence i is
                                            at page block_tables[i, j // PAGE_SIZE],
                                            slot j % PAGE_SIZE
  meta           kernels.metadata.AttnMetadata (cu_seqlens_q, seq_lens, block_tables)

Tiling. One program takes BLOCK_Q consecutive tokens of one sequence times the
G query heads of one KV head: BLOCK_M = BLOCK_Q * G rows (padded to >= 16 for
tl.dot), so each K/V tile is loaded once for the whole group. A key tile of
BLOCK_N keys may span several pages (any page size): each key finds its page
in the block table. Programs find their sequence by binary search over
cu_seqlens_q (no host-side schedule), as vLLM's unified attention does.

Precision. Elementwise softmax maths is fp32. Dot operands stay in the cache's
dtype on a GPU (bf16/fp16 tensor cores, fp32 accumulation, P rounded to the V
dtype as in flash-attention); fp32 inputs, and every input under the
interpreter (whose bf16 dot is broken), are upcast to fp32 and multiplied with
input_precision="ieee", so fp32 is not silently TF32.

Tested with triton 3.9 (interpreter, fp32); written for triton 3.6 on an H200,
where profiling/gpu_check.py runs the same tests.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from agentkv.kernels.metadata import AttnMetadata

# A GPU is filled by a few hundred programs; below that the KV range is split.
_TARGET_PROGRAMS = 512
# A split must amortise its merge: at least this many keys of the longest sequence.
_MIN_KEYS_PER_SPLIT = 512
_MAX_SPLITS = 64


@triton.jit
def _find_seq(
    cu_seqlens_q_ptr,  # [B+1]
    q_block,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    """The sequence whose q blocks contain q_block, where sequence i's blocks
    start at cu_seqlens_q[i] // BLOCK_Q + i (an upper bound of the blocks
    before it, so every sequence has room for ceil(q_len / BLOCK_Q) blocks)."""
    left: tl.int32 = 0
    right: tl.int32 = num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        go_right = start <= q_block
        left = tl.where(go_right, mid + 1, left)
        right = tl.where(go_right, right, mid)
    return left - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, NUM_SPLITS, D]: the output, or fp32 partials when NUM_SPLITS > 1
    lse_ptr,  # [T, Hq, NUM_SPLITS] fp32 base-2 log-sum-exp of the partials (NUM_SPLITS > 1)
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [P, PAGE_SIZE, Hkv, D]
    v_cache_ptr,  # [P, PAGE_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_pages] int32
    seq_lens_ptr,  # [B] int32
    cu_seqlens_q_ptr,  # [B+1] int32
    num_seqs,
    scale_log2,  # softmax scale * log2(e)
    window,  # keys j > p - window are visible; >= every seq_len when there is no window
    stride_out_tok,
    stride_out_head,
    stride_out_split,
    stride_out_dim,
    stride_lse_tok,
    stride_lse_head,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_k_page,
    stride_k_slot,
    stride_k_head,
    stride_k_dim,
    stride_v_page,
    stride_v_slot,
    stride_v_head,
    stride_v_dim,
    stride_bt_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # fp32 dot operands: fp32 inputs, or the interpreter (broken bf16 dot)
):
    dot_dtype = tl.float32 if UPCAST_DOT else k_cache_ptr.dtype.element_ty
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    seq = _find_seq(cu_seqlens_q_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len

    # Row m of the tile is token m // GROUP of the block, query head m % GROUP of the group.
    offs_m = tl.arange(0, BLOCK_M)
    tok_in_seq = q_block_local * BLOCK_Q + offs_m // GROUP
    row_valid = (offs_m // GROUP < BLOCK_Q) & (tok_in_seq < q_len)
    q_pos = ctx_len + tok_in_seq
    tok = (q_start + tok_in_seq).to(tl.int64)
    head = kv_head * GROUP + offs_m % GROUP
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :] * stride_q_dim,
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    ).to(dot_dtype)

    # Keys this block can see: from the window start of its first token to its last token.
    first_pos = ctx_len + q_block_local * BLOCK_Q
    kv_end = ctx_len + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len)
    kv_begin = tl.maximum(first_pos - window + 1, 0)
    tile_begin = kv_begin // BLOCK_N
    num_tiles = tl.cdiv(kv_end, BLOCK_N) - tile_begin
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    split_begin = tile_begin + split * tiles_per_split
    split_end = tl.minimum(split_begin + tiles_per_split, tile_begin + num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile in range(split_begin, split_end):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_valid = (offs_n >= kv_begin) & (offs_n < kv_end)
        page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = offs_n % PAGE_SIZE
        kv_mask = key_valid[None, :] & d_valid[:, None]
        k_t = tl.load(  # [HEAD_DIM_PAD, BLOCK_N]
            k_cache_ptr
            + page[None, :] * stride_k_page
            + slot[None, :] * stride_k_slot
            + kv_head * stride_k_head
            + offs_d[:, None] * stride_k_dim,
            mask=kv_mask,
            other=0.0,
        ).to(dot_dtype)
        s = tl.dot(q, k_t, input_precision="ieee") * scale_log2
        visible = (
            row_valid[:, None]
            & key_valid[None, :]
            & (offs_n[None, :] <= q_pos[:, None])
            & (offs_n[None, :] > q_pos[:, None] - window)
        )
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet keeps m = -inf; subtract 0 there to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(  # [BLOCK_N, HEAD_DIM_PAD]
            v_cache_ptr
            + page[:, None] * stride_v_page
            + slot[:, None] * stride_v_slot
            + kv_head * stride_v_head
            + offs_d[None, :] * stride_v_dim,
            mask=key_valid[:, None] & d_valid[None, :],
            other=0.0,
        ).to(dot_dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), v, input_precision="ieee")
        m_i = m_new

    # An empty split (fewer tiles than splits) stores o = 0 and lse = -inf.
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    tl.store(
        out_ptr
        + tok[:, None] * stride_out_tok
        + head[:, None] * stride_out_head
        + split * stride_out_split
        + offs_d[None, :] * stride_out_dim,
        o.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )
    if NUM_SPLITS > 1:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + tok * stride_lse_tok + head * stride_lse_head + split, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [T, Hq, D]
    part_ptr,  # [T, Hq, NUM_SPLITS, D] fp32
    lse_ptr,  # [T, Hq, NUM_SPLITS] fp32
    stride_out_tok,
    stride_out_head,
    stride_out_dim,
    stride_part_tok,
    stride_part_head,
    stride_part_split,
    stride_lse_tok,
    stride_lse_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_valid = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + tok * stride_lse_tok + head * stride_lse_head + offs_s, mask=s_valid, other=float("-inf"))
    # Every token sees its own key, so at least one split is non-empty and the max is finite.
    weight = tl.exp2(lse - tl.max(lse, axis=0))
    part = tl.load(
        part_ptr + tok * stride_part_tok + head * stride_part_head + offs_s[:, None] * stride_part_split + offs_d[None, :],
        mask=s_valid[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    o = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(
        out_ptr + tok * stride_out_tok + head * stride_out_head + offs_d * stride_out_dim,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _tile_sizes(group: int, max_query_len: int, head_dim_pad: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N). Rows: enough for a verify chunk's tokens times the
    group, so short chunks read their KV once, up to prefill tiles of 128
    (64 for fp32, whose pipelined K/V tiles would overflow shared memory).
    Keys: 64 a tile, 32 when a key's row exceeds 256 bytes."""
    max_rows = 128 if element_size <= 2 else 64
    block_m = max(16, triton.next_power_of_2(group), min(max_rows, triton.next_power_of_2(max_query_len * group)))
    block_n = 64 if head_dim_pad * element_size <= 256 else 32
    return block_m, block_n


def _num_splits(num_programs: int, max_seq_len: int) -> int:
    """Split the KV range when the unsplit grid cannot fill the GPU and the
    context is long enough for each split to stream a useful share."""
    if num_programs >= _TARGET_PROGRAMS:
        return 1
    splits = max(1, min(_MAX_SPLITS, triton.cdiv(_TARGET_PROGRAMS, num_programs), max_seq_len // _MIN_KEYS_PER_SPLIT))
    # A power of two: NUM_SPLITS is a constexpr, and a growing conversation
    # must not compile a new kernel variant at every length.
    return 1 << (splits.bit_length() - 1)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
    sliding_window: int = 0,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton paged attention with the contract of kernels.reference.paged_attention
    (into out, any strides, when given). num_splits forces the number of KV
    splits (1: no split-K); None picks it."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, kv_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or kv_head_dim != head_dim or page_size != meta.page_size:
        raise ValueError(
            f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)} and "
            f"page_size {meta.page_size} disagree"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in _DTYPES:
        raise ValueError(f"q, k_cache, v_cache must share one of {_DTYPES}, got {q.dtype}, {k_cache.dtype}")
    if num_tokens != sum(meta.query_lens_list):
        raise ValueError(f"q has {num_tokens} tokens, the metadata {sum(meta.query_lens_list)}")
    if meta.block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")

    group = num_q_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n = _tile_sizes(group, meta.max_query_len, head_dim_pad, q.element_size())
    block_q = block_m // group
    if num_splits is None:
        active_blocks = sum(triton.cdiv(n, block_q) for n in meta.query_lens_list)
        num_splits = _num_splits(active_blocks * num_kv_heads, meta.max_seq_len)
    window = sliding_window if sliding_window > 0 else meta.max_seq_len

    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be a {q.dtype} {tuple(q.shape)} on {q.device}, not {out.dtype} {tuple(out.shape)}")
    if num_splits == 1:
        part, lse = out.unsqueeze(2), out  # lse is not touched without splits
    else:
        part = torch.empty(num_tokens, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    # Sequence i's blocks start at cu_seqlens_q[i] // BLOCK_Q + i, see _find_seq.
    grid = (num_tokens // block_q + meta.num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out_ptr=part,
        lse_ptr=lse,
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_tables_ptr=meta.block_tables,
        seq_lens_ptr=meta.seq_lens,
        cu_seqlens_q_ptr=meta.cu_seqlens_q,
        num_seqs=meta.num_seqs,
        scale_log2=scale * math.log2(math.e),
        window=window,
        stride_out_tok=part.stride(0),
        stride_out_head=part.stride(1),
        stride_out_split=part.stride(2),
        stride_out_dim=part.stride(3),
        stride_lse_tok=lse.stride(0),
        stride_lse_head=lse.stride(1),
        stride_q_tok=q.stride(0),
        stride_q_head=q.stride(1),
        stride_q_dim=q.stride(2),
        stride_k_page=k_cache.stride(0),
        stride_k_slot=k_cache.stride(1),
        stride_k_head=k_cache.stride(2),
        stride_k_dim=k_cache.stride(3),
        stride_v_page=v_cache.stride(0),
        stride_v_slot=v_cache.stride(1),
        stride_v_head=v_cache.stride(2),
        stride_v_dim=v_cache.stride(3),
        stride_bt_seq=meta.block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        UPCAST_DOT=q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=8 if block_m >= 128 else 4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out_ptr=out,
            part_ptr=part,
            lse_ptr=lse,
            stride_out_tok=out.stride(0),
            stride_out_head=out.stride(1),
            stride_out_dim=out.stride(2),
            stride_part_tok=part.stride(0),
            stride_part_head=part.stride(1),
            stride_part_split=part.stride(2),
            stride_lse_tok=lse.stride(0),
            stride_lse_head=lse.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out
