"""Triton rmsnorm against the torch reference."""
from __future__ import annotations

import pytest
import torch

from agentkv.kernels import reference
from agentkv.kernels.triton_rmsnorm import rmsnorm

SHAPES = [(1, 16), (7, 100), (5, 4096), (2, 3, 24)]
# fp32 differs by summation order only; bf16/fp16 may round one element the other way.
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1.6e-2, 1.6e-2), (torch.float16, 2e-3, 2e-3)]


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype_tol", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, dtype_tol, with_residual, device):
    dtype, atol, rtol = dtype_tol
    if device == "cpu" and dtype != torch.float32:
        pytest.skip("the Triton interpreter rounds bf16/fp16 stores differently from a GPU; checked on CUDA")
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=g)).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device, dtype)
    residual = torch.randn(shape, generator=g).to(device, dtype) if with_residual else None

    out, h = rmsnorm(x, weight, 1e-6, residual)
    out_expected, h_expected = reference.rmsnorm(x, weight, 1e-6, residual)

    assert out.dtype == out_expected.dtype and out.shape == x.shape
    torch.testing.assert_close(out, out_expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(h, h_expected, atol=0, rtol=0)
    if residual is None:
        assert h is x


def test_fp32_weight_promotes_output(device):
    if device == "cpu":
        pytest.skip("bf16 input; the interpreter rounds bf16 stores differently from a GPU")
    x = torch.randn(3, 32, device=device, dtype=torch.bfloat16)
    weight = torch.rand(32, device=device)
    out, _ = rmsnorm(x, weight, 1e-5)
    expected, _ = reference.rmsnorm(x, weight, 1e-5)
    assert out.dtype == torch.float32
    # normed is rounded to bf16 before the fp32 weight: one bf16 rounding apart at most.
    torch.testing.assert_close(out, expected, atol=1.6e-2, rtol=1.6e-2)


def test_strided_rows(device):
    base = torch.randn(6, 48, device=device)
    x, residual = base[:, :32], base[:, 16:]
    weight = torch.randn(32, device=device)
    out, h = rmsnorm(x, weight, 1e-6, residual)
    out_expected, h_expected = reference.rmsnorm(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, out_expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_expected, atol=0, rtol=0)
