"""The fused CPU ops (kernels/cpu_fused_ops.py) against their torch references
(kernels/reference.py), bit for bit: residual add + RMSNorm over row widths
on and off ATen's vector and cascade edges, both dtypes, with and without a
residual; RoPE + K/V store over ragged steps that cross pages, GQA ratios,
head dims, page sizes and cache layouts; SiLU * mul over widths on and off
the vector chunks of ATen's silu. A row's (a token's) bits must not
depend on the batch, and bad input must change nothing."""
from __future__ import annotations

import warnings

import pytest
import torch

from agentkv.kernels import dispatch
from agentkv.kernels import cpu_fused_ops, reference
from agentkv.kernels.metadata import AttnMetadata
from agentkv.model.rope import rope_tables
from tests.cpu_kernels import built_on_each_isa

# Every test on each vector ISA this CPU runs, with its kernels built for it (a failed build fails on x86).
_built = built_on_each_isa(cpu_fused_ops)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Widths: below one 8-lane vector (scalar sums), one vector, a scalar tail,
# the embedded model's 384 and 704, SmolLM2's 576, and past one 16-chunk
# cascade level (4 * 8 * 16 = 512 floats) and two (8192).
WIDTHS = [1, 7, 8, 9, 40, 384, 576, 704, 1000, 8197]


def _rows(rows: int, width: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    # Scaled so that squares and sums round (values of a few units, as residual streams hold).
    x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
    residual = torch.randn(rows, width, generator=g).to(dtype)
    weight = (1 + 0.5 * torch.randn(width, generator=g)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rmsnorm_matches_reference_bits(dtype, width, with_residual):
    x, residual, weight = _rows(5, width, dtype, seed=width)
    before = x.clone(), residual.clone()
    res = residual if with_residual else None
    out, h = cpu_fused_ops.rmsnorm(x, weight, 1e-6, res)
    want_out, want_h = reference.rmsnorm(x, weight, 1e-6, res)
    assert out.dtype == dtype and torch.equal(out, want_out)
    assert torch.equal(h, want_h)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rmsnorm_row_bits_do_not_depend_on_the_batch(dtype):
    x, residual, weight = _rows(70, 384, dtype, seed=1)  # enough rows to split over threads
    batch = cpu_fused_ops.rmsnorm(x, weight, 1e-5, residual)
    for r in (0, 33, 69):
        alone = cpu_fused_ops.rmsnorm(x[r : r + 1], weight, 1e-5, residual[r : r + 1])
        assert torch.equal(alone[0][0], batch[0][r]) and torch.equal(alone[1][0], batch[1][r])


def test_rmsnorm_keeps_a_leading_shape():
    x, residual, weight = _rows(6, 40, torch.float32, seed=2)
    out, h = cpu_fused_ops.rmsnorm(x.view(2, 3, 40), weight, 1e-6, residual.view(2, 3, 40))
    want = reference.rmsnorm(x, weight, 1e-6, residual)
    assert out.shape == (2, 3, 40) and torch.equal(out.view(6, 40), want[0]) and torch.equal(h.view(6, 40), want[1])


def test_rmsnorm_refuses_bad_input():
    x, residual, weight = _rows(4, 16, torch.float32, seed=3)
    with pytest.raises(ValueError, match="weight"):
        cpu_fused_ops.rmsnorm(x, weight.bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        cpu_fused_ops.rmsnorm(x, weight[:8], 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_fused_ops.rmsnorm(x.t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        cpu_fused_ops.rmsnorm(x, weight, 1e-6, residual[:2])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_fused_ops.rmsnorm(x.half(), weight.half(), 1e-6)


# (page_size, (q heads, kv heads), head_dim, [(query_len, cached_len)])
ROPE_CASES = [
    (4, (6, 2), 64, [(1, 37), (5, 3), (17, 0), (1, 0)]),  # the embedded model's heads; decodes, a verify, a chunk
    (16, (9, 3), 64, [(1, 100), (33, 15)]),  # SmolLM2's; a chunk across three pages
    (1, (4, 4), 16, [(3, 2), (1, 5)]),  # one slot a page: every token its own page
    (8, (8, 1), 128, [(9, 7), (2, 30)]),
    (4, (2, 1), 2, [(6, 1)]),  # the smallest head_dim
]


def _rope_case(case, dtype: torch.dtype, layout: str, seed: int = 0):
    """q, k, v as slices of one [T, Hq + 2 Hkv, D] projection (as the model
    passes them), the tables, random caches in the layout asked for, and the
    step's metadata over scattered pages."""
    page_size, (hq, hkv), d, spec = case
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in spec]
    pages = [-(-s // page_size) for s in seq_lens]
    total = sum(pages) + 2
    order = torch.randperm(total, generator=g).tolist()
    tables, start = [], 0
    for n in pages:
        tables.append(order[start : start + n])
        start += n
    meta = AttnMetadata.build([q for q, _ in spec], seq_lens, tables, page_size)
    t = meta.num_tokens
    qkv = (torch.randn(t, hq + 2 * hkv, d, generator=g) * 2).to(dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    cos, sin = rope_tables(d, 256, 10000.0, None)
    shape = (2, total, page_size, hkv, d)
    if layout == "head-major":  # as the pool stores it
        kv = torch.randn(2, hkv, total, page_size, d, generator=g).to(dtype).permute(0, 2, 3, 1, 4)
    elif layout == "contiguous":
        kv = torch.randn(shape, generator=g).to(dtype)
    else:  # every other element of head_dim: no unit stride anywhere
        kv = torch.randn(*shape[:-1], 2 * d, generator=g).to(dtype)[..., ::2]
        q, k, v = (x.repeat_interleave(2, dim=-1)[..., ::2] for x in (q, k, v))
    return q, k, v, cos, sin, kv, meta


@pytest.mark.parametrize("layout", ["head-major", "contiguous", "strided"])
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"ps{c[0]}-h{c[1][0]}x{c[1][1]}-d{c[2]}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rope_and_store_matches_reference_bits(dtype, case, layout):
    q, k, v, cos, sin, kv, meta = _rope_case(case, dtype, layout)
    kv_want = kv.clone()
    k_in, v_in = k.clone(), v.clone()
    want = reference.rope_and_store(q.clone(), k, v, cos, sin, kv_want[0], kv_want[1], meta)
    got = cpu_fused_ops.rope_and_store(q, k, v, cos, sin, kv[0], kv[1], meta)
    assert got is q  # rotated in place
    assert torch.equal(got, want)
    assert torch.equal(kv, kv_want)  # the new tokens' slots, and nothing else
    assert torch.equal(k, k_in) and torch.equal(v, v_in)


@pytest.mark.parametrize("layout", ["head-major", "strided"])
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"ps{c[0]}-h{c[1][0]}x{c[1][1]}-d{c[2]}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rope_and_store_with_qk_norm_matches_reference_bits(dtype, case, layout):
    """Qwen3's per-head q and k norms before the rotation: fresh q rows, and
    the caller's q, k and v left as they were."""
    q, k, v, cos, sin, kv, meta = _rope_case(case, dtype, layout)
    g = torch.Generator().manual_seed(4)
    q_norm, k_norm = ((torch.randn(q.shape[-1], generator=g) * 0.5 + 1).to(dtype) for _ in range(2))
    kv_want, kv_plain = kv.clone(), kv.clone()
    q_in, k_in, v_in = q.clone(), k.clone(), v.clone()
    want = reference.rope_and_store(q, k, v, cos, sin, kv_want[0], kv_want[1], meta, q_norm, k_norm, 1e-6)
    got = cpu_fused_ops.rope_and_store(q, k, v, cos, sin, kv[0], kv[1], meta, q_norm, k_norm, 1e-6)
    plain = reference.rope_and_store(q, k, v, cos, sin, kv_plain[0], kv_plain[1], meta)
    assert torch.equal(got, want) and not torch.equal(got, plain)
    assert torch.equal(kv, kv_want) and not torch.equal(kv, kv_plain)
    assert torch.equal(q, q_in) and torch.equal(k, k_in) and torch.equal(v, v_in)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rope_token_bits_do_not_depend_on_the_batch(dtype):
    case = (4, (6, 2), 64, [(70, 10), (1, 37), (5, 3)])  # enough tokens to split over threads
    q, k, v, cos, sin, kv, meta = _rope_case(case, dtype, "head-major")
    q_alone = q[70:71].clone()  # the decode of the second sequence, alone
    kv_alone = kv.clone()
    one = AttnMetadata.build([1], [meta.seq_lens_list[1]], [meta.block_tables[1].tolist()], 4)
    cpu_fused_ops.rope_and_store(q_alone, k[70:71], v[70:71], cos, sin, kv_alone[0], kv_alone[1], one)
    cpu_fused_ops.rope_and_store(q, k, v, cos, sin, kv[0], kv[1], meta)
    assert torch.equal(q_alone[0], q[70])
    page, off = divmod(int(meta.slot_mapping[70]), 4)
    assert torch.equal(kv_alone[:, page, off], kv[:, page, off])


@pytest.mark.parametrize("field,error", [("positions", IndexError), ("slot_mapping", IndexError)])
def test_rope_and_store_out_of_range_changes_nothing(field, error):
    q, k, v, cos, sin, kv, meta = _rope_case(ROPE_CASES[0], torch.float32, "head-major")
    bad = getattr(meta, field).clone()
    bad[-1] = cos.shape[0] if field == "positions" else kv.shape[1] * kv.shape[2]
    setattr(meta, field, bad)
    q_before, kv_before = q.clone(), kv.clone()
    with pytest.raises(error, match="position" if field == "positions" else "slot"):
        cpu_fused_ops.rope_and_store(q, k, v, cos, sin, kv[0], kv[1], meta)
    assert torch.equal(q, q_before) and torch.equal(kv, kv_before)


def test_rope_and_store_refuses_mixed_dtypes():
    q, k, v, cos, sin, kv, meta = _rope_case(ROPE_CASES[0], torch.float32, "head-major")
    with pytest.raises(ValueError, match="dtype"):
        cpu_fused_ops.rope_and_store(q, k, v, cos, sin, kv[0].bfloat16(), kv[1].bfloat16(), meta)
    with pytest.raises(ValueError, match="cos and sin"):
        cpu_fused_ops.rope_and_store(q, k, v, cos.double(), sin.double(), kv[0], kv[1], meta)


def test_select_and_dispatchers_run_the_fused_ops():
    x = torch.zeros(2, 64)
    k_cache = torch.zeros(4, 4, 2, 64)
    chosen = dispatch.select(x, k_cache)
    assert chosen.rmsnorm is cpu_fused_ops.rmsnorm and chosen.rope_and_store is cpu_fused_ops.rope_and_store
    assert chosen.silu_mul is cpu_fused_ops.silu_mul
    # bf16 activations over an fp32 cache: the fused ops take one dtype, so the references run.
    mixed = dispatch.select(x.bfloat16(), k_cache)
    assert mixed.rmsnorm is reference.rmsnorm and mixed.rope_and_store is reference.rope_and_store
    x, residual, weight = _rows(3, 64, torch.float32, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(dispatch.rmsnorm(x, weight, 1e-6, residual),
                                                 reference.rmsnorm(x, weight, 1e-6, residual)))


def test_a_failed_build_falls_back_to_the_references_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpu_fused_ops.extension, "error", "no g++ here")
    monkeypatch.setattr(dispatch, "_warned_fused", [])
    x = torch.zeros(1, 16)
    with pytest.warns(RuntimeWarning, match="no g"):
        chosen = dispatch.select(x, torch.zeros(2, 4, 1, 16))
    assert chosen.rmsnorm is reference.rmsnorm and chosen.rope_and_store is reference.rope_and_store
    assert chosen.silu_mul is reference.silu_mul
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.rmsnorm(x, torch.ones(16), 1e-6)
    with pytest.raises(cpu_fused_ops.CpuKernelUnavailable, match="no g\\+\\+"):
        cpu_fused_ops.rmsnorm(x, torch.ones(16), 1e-6)


@pytest.mark.parametrize("scale", [1.0, 30.0], ids=["unit", "saturating"])
@pytest.mark.parametrize("width", [1, 15, 16, 31, 32, 33, 64, 65, 704, 1536, 4099])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_silu_mul_matches_reference_bits(dtype, width, scale):
    # Widths on and off the vector chunks ATen's silu takes whole (16/32 fp32, 32/64 bf16).
    g = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(5, 2 * width, generator=g) * scale).to(dtype)
    out = cpu_fused_ops.silu_mul(gate_up)
    assert out.shape == (5, width) and torch.equal(out, reference.silu_mul(gate_up))
    for r in (0, 4):  # a row alone: the same bits
        assert torch.equal(cpu_fused_ops.silu_mul(gate_up[r : r + 1]), out[r : r + 1])


def test_silu_mul_refuses_bad_input():
    with pytest.raises(ValueError, match="gate_up"):
        cpu_fused_ops.silu_mul(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="gate_up"):
        cpu_fused_ops.silu_mul(torch.zeros(8, 4).t())
