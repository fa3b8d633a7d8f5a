"""Batched verification of n-gram drafts: how many drafts each sequence keeps
and the token that follows them, for the whole batch in one launch.

Maths (see kernels.reference.verify_drafts for the full contract). Sequence
i's target rows r_0 .. r_n (n = draft_lens[i]) start at cu_rows[i].
  Greedy (target = logits): accept while argmax(r_j) == drafts[i, j]; the
    next token is the argmax of the first mismatching row, or of r_n. Ties
    go to the lowest index.
  Sampling (target = probabilities, one uniform per row): accept x = drafts[i, j]
    iff u_j < p_j(x). On the first rejection draw from p_j without x by
    inverse CDF with u' = (u_j - p_j(x)) / (1 - p_j(x)); if all are accepted,
    draw from r_n with u_n. Inverse CDF: the first index whose cumulative
    mass exceeds u times the row's total, else the last index with positive
    mass. Sums and thresholds are fp64, as in the reference, so both pick
    the same token unless a CDF step lies within ~1e-16 of the threshold.

Layouts: target [R, V] (contiguous last dim, any float dtype), cu_rows [B+1],
drafts [B, K] int64 (entries in [0, V)), draft_lens [B] int32,
uniforms [B, K+1] fp32. One program per sequence walks its rows in order
and stops at the first rejection; each row is read in BLOCK_V chunks, so V
of 150k costs a few dozen iterations and no extra memory.

Tested with triton 3.9 (interpreter); written for triton 3.6 on an H200,
where profiling/gpu_check.py runs the same tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK_V = 4096


@triton.jit
def _row_argmax(row_ptr, vocab_size, BLOCK_V: tl.constexpr):
    """Index of the row's maximum, the lowest one on ties (as torch.argmax)."""
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, axis=0)
        block_idx = tl.min(tl.where(x == block_max, offs, vocab_size), axis=0)
        # Strictly greater: an earlier block keeps a tie.
        better = block_max > best_val
        best_idx = tl.where(better, block_idx, best_idx)
        best_val = tl.where(better, block_max, best_val)
    return best_idx


@triton.jit
def _row_total(row_ptr, exclude, vocab_size, BLOCK_V: tl.constexpr):
    """fp64 sum of the row without index exclude (-1 excludes nothing)."""
    total = tl.full([], 0.0, tl.float64)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        p = tl.load(row_ptr + offs, mask=offs < vocab_size, other=0.0).to(tl.float64)
        total += tl.sum(tl.where(offs == exclude, 0.0, p), axis=0)
    return total


@triton.jit
def _row_inverse_cdf(row_ptr, exclude, threshold, vocab_size, BLOCK_V: tl.constexpr):
    """First index whose fp64 cumulative mass (index exclude left out) exceeds
    threshold, else the last index with positive mass (0 if none)."""
    found = vocab_size
    last_positive = tl.full([], 0, tl.int32)
    running = tl.full([], 0.0, tl.float64)
    start = tl.full([], 0, tl.int32)
    while (found == vocab_size) & (start < vocab_size):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < vocab_size
        p = tl.load(row_ptr + offs, mask=valid, other=0.0).to(tl.float64)
        p = tl.where(offs == exclude, 0.0, p)
        cdf = running + tl.cumsum(p, axis=0)
        found = tl.min(tl.where(valid & (cdf > threshold), offs, vocab_size), axis=0)
        last_positive = tl.maximum(last_positive, tl.max(tl.where(p > 0.0, offs, 0), axis=0))
        running += tl.sum(p, axis=0)
        start += BLOCK_V
    return tl.where(found < vocab_size, found, last_positive)


@triton.jit
def _verify_drafts_kernel(
    num_accepted_ptr,  # [B] int32
    next_token_ptr,  # [B] int64
    target_ptr,  # [R, V]
    cu_rows_ptr,  # [B+1]
    drafts_ptr,  # [B, K] int64
    draft_lens_ptr,  # [B] int32
    uniforms_ptr,  # [B, K+1] fp32 (SAMPLING)
    vocab_size,
    stride_target_row,
    stride_drafts_seq,
    stride_uniforms_seq,
    SAMPLING: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    first_row = tl.load(cu_rows_ptr + seq).to(tl.int64)
    draft_len = tl.load(draft_lens_ptr + seq)
    drafts_row_ptr = drafts_ptr + seq * stride_drafts_seq
    num_accepted: tl.int32 = 0
    if SAMPLING:
        u_row_ptr = uniforms_ptr + seq * stride_uniforms_seq
        # Accepting a draft takes one probability, not a pass over the row.
        going = draft_len > 0
        while going:
            x = tl.load(drafts_row_ptr + num_accepted)
            p_x = tl.load(target_ptr + (first_row + num_accepted) * stride_target_row + x)
            accept = tl.load(u_row_ptr + num_accepted) < p_x
            num_accepted += accept.to(tl.int32)
            going = accept & (num_accepted < draft_len)
        row_ptr = target_ptr + (first_row + num_accepted) * stride_target_row
        rejected = num_accepted < draft_len
        x = tl.load(drafts_row_ptr + num_accepted, mask=rejected, other=-1)
        p_x = tl.load(row_ptr + x, mask=rejected, other=0.0).to(tl.float64)
        u = tl.load(u_row_ptr + num_accepted).to(tl.float64)
        # The rescaled uniform; with nothing rejected (x = -1, p_x = 0) it is u itself.
        u_residual = (u - p_x) / (1.0 - p_x)
        threshold = u_residual * _row_total(row_ptr, x, vocab_size, BLOCK_V)
        token = _row_inverse_cdf(row_ptr, x, threshold, vocab_size, BLOCK_V)
    else:
        token: tl.int32 = -1
        while token < 0:
            best = _row_argmax(target_ptr + (first_row + num_accepted) * stride_target_row, vocab_size, BLOCK_V)
            has_draft = num_accepted < draft_len
            accept = has_draft & (best == tl.load(drafts_row_ptr + num_accepted, mask=has_draft, other=-1))
            token = tl.where(accept, -1, best)
            num_accepted += accept.to(tl.int32)
    tl.store(num_accepted_ptr + seq, num_accepted)
    tl.store(next_token_ptr + seq, token.to(tl.int64))


def verify_drafts(
    target: torch.Tensor,
    cu_rows: torch.Tensor,
    drafts: torch.Tensor,
    draft_lens: torch.Tensor,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton verify_drafts with the contract of kernels.reference.verify_drafts."""
    if target.dim() != 2 or target.stride(1) != 1:
        raise ValueError(f"target must be [R, V] with a contiguous last dim, got {tuple(target.shape)}")
    if drafts.dim() != 2 or drafts.dtype != torch.int64:
        raise ValueError(f"drafts must be [B, K] int64, got {tuple(drafts.shape)} {drafts.dtype}")
    num_seqs, max_drafts = drafts.shape
    if draft_lens.shape != (num_seqs,) or cu_rows.shape != (num_seqs + 1,):
        raise ValueError(f"draft_lens {tuple(draft_lens.shape)} and cu_rows {tuple(cu_rows.shape)} must fit B={num_seqs}")
    if uniforms is not None and (uniforms.shape != (num_seqs, max_drafts + 1) or uniforms.dtype != torch.float32):
        raise ValueError(f"uniforms must be fp32 [{num_seqs}, {max_drafts + 1}], got {tuple(uniforms.shape)} {uniforms.dtype}")
    device = target.device
    num_accepted = torch.empty(num_seqs, dtype=torch.int32, device=device)
    next_token = torch.empty(num_seqs, dtype=torch.int64, device=device)
    if num_seqs == 0:
        return num_accepted, next_token
    vocab_size = target.shape[1]
    block_v = min(triton.next_power_of_2(vocab_size), _MAX_BLOCK_V)
    _verify_drafts_kernel[(num_seqs,)](
        num_accepted_ptr=num_accepted,
        next_token_ptr=next_token,
        target_ptr=target,
        cu_rows_ptr=cu_rows,
        drafts_ptr=drafts,
        draft_lens_ptr=draft_lens,
        uniforms_ptr=uniforms if uniforms is not None else target,  # not read when greedy
        vocab_size=vocab_size,
        stride_target_row=target.stride(0),
        stride_drafts_seq=drafts.stride(0),
        stride_uniforms_seq=uniforms.stride(0) if uniforms is not None else 0,
        SAMPLING=uniforms is not None,
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )
    return num_accepted, next_token
