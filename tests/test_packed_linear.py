"""oneDNN's packed linears against plain matmuls, alone and in the model."""
from __future__ import annotations

import pytest
import torch

from agentkv.experiments.common import random_model
from agentkv.kernels.metadata import AttnMetadata
from agentkv.model import packed_linear
from agentkv.model.default import random_init
from agentkv.model.llama import linear

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


def needs(dtype: torch.dtype) -> None:
    if not packed_linear.supported(dtype, torch.device("cpu")):
        pytest.skip(f"oneDNN does not run {dtype} linears on this CPU")


@pytest.mark.parametrize("dtype_tol", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_matmul(dtype_tol, rows, bias):
    dtype, tol = dtype_tol
    needs(dtype)
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 160, generator=g).to(dtype)  # [in, out]
    b = torch.randn(160, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 96, generator=g).to(dtype)
    want = x.double() @ weight.double() + (b.double() if bias else 0)
    got = packed_linear.packed_linear(x, packed_linear.pack(weight), b)
    assert got.dtype == dtype and got.shape == (rows, 160)
    torch.testing.assert_close(got.double(), want, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(linear(x, weight, b, packed_linear.PackedWeights()).double(), want, atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(96, 160), (576, 960), (1536, 576), (2048, 96)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_rows_do_not_depend_on_row_count(dtype, shape, bias):
    """Batch invariance: a row's bits are the same however many rows share the
    call, one row included (in fp32 oneDNN's one-row kernel sums differently
    from 1536 inputs on, so linear pads it)."""
    needs(dtype)
    g = torch.Generator().manual_seed(shape[0])
    weight = torch.randn(*shape, generator=g).to(dtype)
    b = torch.randn(shape[1], generator=g).to(dtype) if bias else None
    x = torch.randn(64, shape[0], generator=g).to(dtype)
    packed = packed_linear.PackedWeights()
    every = linear(x, weight, b, packed)
    for rows in (1, 2, 3, 5, 17):
        assert torch.equal(linear(x[:rows], weight, b, packed), every[:rows]), f"{rows} rows"
        assert torch.equal(linear(x[-rows:], weight, b, packed), every[-rows:]), f"last {rows} rows"


def _logits(model, n: int) -> torch.Tensor:
    cfg = model.cfg
    pages = -(-n // 16)
    kv = torch.zeros(cfg.num_layers, 2, pages, 16, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    meta = AttnMetadata.build([n], [n], [list(range(pages))], 16)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(3))
    return model(ids, meta, kv)


@pytest.mark.parametrize("dtype_tol", DTYPES, ids=["fp32", "bf16"])
def test_prepacked_model_matches_plain(dtype_tol):
    dtype, tol = dtype_tol
    needs(dtype)
    model = random_model("tiny", dtype)
    plain = _logits(model, 40)
    model.prepack()
    assert model.packed is not None
    assert all(m.packed is model.packed for b in model.blocks for m in (b.attn, b.mlp))
    # bf16 rounds each layer's output; the differences compound over 4 layers.
    torch.testing.assert_close(_logits(model, 40), plain, atol=tol * 10, rtol=tol * 10)
    # Weights written in place after packing (as a test or a trainer does) are
    # packed again, not served stale.
    random_init(model, 7)
    fresh = random_model("tiny", dtype, seed=7)
    torch.testing.assert_close(_logits(model, 40), _logits(fresh, 40), atol=tol * 10, rtol=tol * 10)
    model.prepack(False)
    assert model.packed is None and model.blocks[0].mlp.packed is None
    torch.testing.assert_close(_logits(model, 40), _logits(fresh, 40), atol=0, rtol=0)


def test_prepack_skips_what_onednn_does_not_run():
    model = random_model("tiny", torch.float16)
    model.prepack()
    assert model.packed is None and model.blocks[0].attn.packed is None
