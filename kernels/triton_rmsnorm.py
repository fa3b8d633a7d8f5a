"""RMSNorm with a fused residual add, fp32 statistics (HF Llama semantics).

Maths, per row of D elements, with the reference's roundings:

    h   = round_x(x + residual)            (h = x without a residual)
    out = round_out(weight * round_x(h / sqrt(mean(h^2) + eps)))

where round_x rounds to x's dtype and out has the promoted dtype of weight
and x. Returns (out, h); without a residual, h is x itself (no copy).

Layout: x and residual [..., D] with a contiguous last dim; weight [D].
One program per row; the row is one block of next_power_of_2(D) lanes.

Tested with triton 3.9 (interpreter, fp32); written for triton 3.6 on an H200,
where profiling/gpu_check.py runs the same tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    out_ptr,  # [N, D]
    residual_out_ptr,  # [N, D] (HAS_RESIDUAL)
    x_ptr,  # [N, D]
    residual_ptr,  # [N, D] (HAS_RESIDUAL)
    weight_ptr,  # [D]
    eps,
    stride_out_row,
    stride_res_out_row,
    stride_x_row,
    stride_res_row,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    h = tl.load(x_ptr + row * stride_x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual_ptr + row * stride_res_row + offs, mask=mask, other=0.0).to(tl.float32)
        # The statistics see the sum as rounded to x's dtype, as the reference's do.
        h = h.to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_res_out_row + offs, h, mask=mask)
        h = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    normed = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + offs, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton rmsnorm with the contract of kernels.reference.rmsnorm."""
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if x.stride(-1) != 1 or weight.stride(0) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("x, residual and weight must be contiguous in their last dim")
    x2 = x.reshape(-1, dim)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, dim)
    if residual is None:
        h, h2, res2 = x, x2, x2  # the residual pointers are not read
    else:
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        h2, res2 = h.view(-1, dim), residual.reshape(-1, dim)
    block_d = triton.next_power_of_2(dim)
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](
            out_ptr=out2,
            residual_out_ptr=h2,
            x_ptr=x2,
            residual_ptr=res2,
            weight_ptr=weight,
            eps=eps,
            stride_out_row=out2.stride(0),
            stride_res_out_row=h2.stride(0),
            stride_x_row=x2.stride(0),
            stride_res_row=res2.stride(0),
            D=dim,
            BLOCK_D=block_d,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block_d // 512)),
        )
    return out, h
