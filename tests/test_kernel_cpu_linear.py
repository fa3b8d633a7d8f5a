"""The weight-streaming CPU linear (kernels/cpu_linear.py) against an fp64
matmul, its bit invariance over the rows that share a call, repacking when a
weight changes, and the fallback to oneDNN when the extension cannot build."""
from __future__ import annotations

import warnings

import pytest
import torch

from agentkv.kernels import cpu_linear
from agentkv.model import packed_linear
from agentkv.model.llama import linear
from tests.cpu_kernels import built_on_each_isa

# Every test on each vector ISA this CPU runs, with its kernels built for it (a failed build fails on x86).
_built = built_on_each_isa(cpu_linear)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def needs(dtype: torch.dtype) -> None:
    if dtype not in cpu_linear.dtypes():
        pytest.skip(f"the C++ linear has no {dtype} code for this CPU: no AVX2 or AVX-512")


def case(n_in: int, n_out: int, rows: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_in, n_out, generator=g).to(dtype)
    b = torch.randn(n_out, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, n_in, generator=g).to(dtype)
    return x, w, b


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """fp64 sums of the same (rounded) inputs."""
    y = x.double() @ w.double()
    return y + b.double() if b is not None else y


# (in, out): whole blocks, ragged blocks and pairs (odd in), fewer outputs
# than a block, tiles of 1-4 blocks (and 5-8, bf16's tiles at 1-2 rows:
# 80, 96, 112, 113 outputs), the model's shapes.
SHAPES = [(1, 1), (3, 17), (7, 5), (32, 64), (33, 80), (32, 96), (41, 112), (64, 113), (96, 160), (129, 47),
          (576, 960), (1536, 576)]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 33])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_fp64(dtype, shape, rows, bias):
    needs(dtype)
    x, w, b = case(*shape, rows, dtype, bias, seed=rows)
    got = cpu_linear.linear(x, cpu_linear.pack(w), b)
    want = reference(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, shape[1])
    # fp32 sums of n products: error ~ sqrt(n) ulps of the sum's scale; bf16
    # is then rounded once (half an ulp of the result: 2^-9 relative).
    scale = (x.double().abs() @ w.double().abs()).max().item() + 1
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=scale * 1e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(got.double(), want, atol=scale * 1e-5, rtol=2**-8)
        # One rounding of an fp32 sum: within a bf16 ulp of the fp64 result
        # rounded, and equal to it but near rounding boundaries.
        rounded = want.to(dtype).double()
        assert ((got.double() - rounded).abs() <= rounded.abs() * 2**-7 + scale * 1e-6).all()
        assert (got.double() == rounded).double().mean() > 0.9


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_output_is_rounded_once_as_torch_rounds(dtype):
    """The fp32 sum (+ bias) rounded to the dtype as .to(dtype) rounds it,
    denormals and infinities included: with one input the sum is exact."""
    needs(dtype)
    values = torch.tensor([1.0, -2.5, 1e-39, -3e-40, 3.0e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 65504.0, 0.0, -0.0])
    w = torch.ones(1, values.numel(), dtype=dtype)
    x = torch.ones(1, 1, dtype=dtype)
    b = values.to(dtype)
    got = cpu_linear.linear(x, cpu_linear.pack(w), b)
    want = (torch.ones(values.numel()) + b.float()).to(dtype)
    assert torch.equal(got[0], want)
    big = torch.full((1, 2), 3.0e38).to(dtype)  # overflows the fp32 sum: inf, as torch gives
    got = cpu_linear.linear(torch.ones(1, 2, dtype=dtype), cpu_linear.pack(big.t().contiguous()), None)
    assert torch.isinf(got).all()


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", [(96, 160), (577, 960), (1536, 576), (2048, 97)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_the_batch(dtype, shape, threads):
    """Batch invariance: a row's bits are the same alone, among a few (a
    verify), or among hundreds (a prefill chunk), at any place in the call,
    whatever tile of rows it falls in."""
    needs(dtype)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w, b = case(*shape, 300, dtype, True, seed=shape[1])
        packed = cpu_linear.pack(w)
        every = cpu_linear.linear(x, packed, b)
        for rows in (1, 2, 3, 5, 6, 7, 17, 33):
            assert torch.equal(cpu_linear.linear(x[:rows], packed, b), every[:rows]), f"{rows} rows"
            assert torch.equal(cpu_linear.linear(x[-rows:], packed, b), every[-rows:]), f"last {rows} rows"
            assert torch.equal(cpu_linear.linear(x[3 : 3 + rows], packed, b), every[3 : 3 + rows]), f"{rows} at 3"
    finally:
        torch.set_num_threads(old)


def test_amx_runs_where_the_cpu_has_it(cpu_isa):
    """bf16 weights with inputs in multiples of 32 (the tests' shapes above
    included) run on the AMX tiles wherever the AVX-512 build's CPU has
    them: a tile path that silently fell back would leave prefill several
    times slower with every test green."""
    from agentkv.kernels.cpu_extension import _cpu_flags

    has = {"amx_tile", "amx_bf16"} <= _cpu_flags() and cpu_isa == "avx512"
    assert cpu_linear.amx() == has


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 31, 32, 33, 64, 100])
def test_amx_tiles_match_fp64_across_row_tiles(rows):
    """Rows in whole and short 16-row tiles, one or two at a time, and an odd
    count of 16-output blocks: each matches the fp64 sums as the vector code
    does, and its bits do not depend on the rows beside it."""
    needs(torch.bfloat16)
    x, w, b = case(64, 48, rows, torch.bfloat16, True, seed=rows)
    packed = cpu_linear.pack(w)
    got = cpu_linear.linear(x, packed, b)
    want = reference(x, w, b)
    scale = (x.double().abs() @ w.double().abs()).max().item() + 1
    torch.testing.assert_close(got.double(), want, atol=scale * 1e-5, rtol=2**-8)
    for r in range(rows):
        assert torch.equal(cpu_linear.linear(x[r : r + 1], packed, b)[0], got[r]), f"row {r} alone"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_strided_rows_and_bad_input(dtype):
    needs(dtype)
    x, w, b = case(64, 48, 9, dtype, True)
    packed = cpu_linear.pack(w)
    wide = torch.cat([x, x], dim=1)[:, :64]  # rows strided, as a slice of a fused output is
    assert torch.equal(cpu_linear.linear(wide, packed, b), cpu_linear.linear(x, packed, b))
    with pytest.raises(ValueError):
        cpu_linear.linear(x[:, :63], packed, b)
    with pytest.raises(ValueError):
        cpu_linear.linear(x.double(), packed, b)
    with pytest.raises(ValueError):
        cpu_linear.pack(w.half())
    with pytest.raises(RuntimeError, match="bias"):
        cpu_linear.linear(x, packed, b[:-1])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_packed_weights_repack_when_a_weight_changes(dtype):
    """PackedWeights("cpp") packs a weight once, again after a write in place
    (its version counter moves) or when the tensor is replaced, not for a
    write through .data (documented: prepack again after one)."""
    needs(dtype)
    x, w, b = case(40, 24, 3, dtype, False)
    packed = packed_linear.PackedWeights("cpp")
    first = linear(x, w, None, packed)
    assert packed.get(w) is packed.get(w)
    with torch.no_grad():
        w.mul_(2)
    assert torch.equal(linear(x, w, None, packed), cpu_linear.linear(x, cpu_linear.pack(w)))
    assert not torch.equal(linear(x, w, None, packed), first)
    w2 = w.clone()
    w2.data.zero_()
    assert torch.equal(linear(x, w2, None, packed), torch.zeros(3, 24, dtype=dtype))
    stale = linear(x, w2, None, packed)
    w2.data.fill_(1)  # not seen
    assert torch.equal(linear(x, w2, None, packed), stale)


def test_a_failed_build_falls_back_to_onednn_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpu_linear.extension, "error", "building cpu_linear.cpp failed: no g++")
    monkeypatch.setattr(packed_linear, "_warned", [])
    cpu = torch.device("cpu")
    with pytest.warns(RuntimeWarning, match="no g\\+\\+"):
        chosen = packed_linear.choose(torch.float32, cpu)
    assert chosen == ("onednn" if packed_linear.supported(torch.float32, cpu) else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert packed_linear.choose(torch.float32, cpu) == chosen  # warned once
        assert packed_linear.choose(torch.float32, cpu, "cpp") is None
    assert cpu_linear.dtypes() == ()
    with pytest.raises(cpu_linear.CpuKernelUnavailable, match="no g\\+\\+"):
        cpu_linear.linear(torch.ones(1, 4), cpu_linear.pack(torch.ones(4, 4)))


def test_choose_prefers_the_kernel_and_rejects_unknown_names():
    cpu = torch.device("cpu")
    for dtype in cpu_linear.dtypes():
        assert packed_linear.choose(dtype, cpu) == "cpp"
    assert packed_linear.choose(torch.float32, torch.device("meta")) is None
    assert packed_linear.choose(torch.float16, cpu, "cpp") is None
    with pytest.raises(ValueError):
        packed_linear.choose(torch.float32, cpu, "mkl")
    with pytest.raises(ValueError):
        packed_linear.PackedWeights("auto")


@pytest.mark.slow
def test_bench_runs_and_sums_a_step():
    """Smoke test of experiments.benchmarks.bench_cpu_linear on agent-8m's shapes."""
    needs(torch.float32)
    from agentkv.experiments.benchmarks import bench_cpu_linear

    res = bench_cpu_linear.main(["--models", "agent-8m", "--rows", "1,3", "--threads", "1", "--dtypes", "float32",
                                 "--repeats", "1", "--stream-mb", "1"])
    assert len(res["rows"]) == 5 * 2 and res["read_GBps"][1] > 0
    step = {s["rows"]: s for s in res["step"]}
    per_layer = sum(r["cpp_ms"] * r["per_step"] for r in res["rows"] if r["rows"] == 3)
    assert step[3]["cpp_ms"] == pytest.approx(per_layer) and step[1]["weight_MB"] > 15
