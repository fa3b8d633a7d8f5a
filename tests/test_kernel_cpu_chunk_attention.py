"""The CPU prompt-chunk attention kernel (kernels/cpu_chunk_attention.py)
against the naive fp64 softmax oracle, over ragged batches, page and
64-key tile boundaries, row blocks (96 rows of query x group head) cut
anywhere, GQA ratios, head dims with and without vdpbf16ps, sliding windows
and both dtypes; its bits against placement, batch and chunking; and its
dispatch beside the decode kernel."""
from __future__ import annotations

import random
import warnings

import pytest
import torch

from agentkv.kernels import dispatch
from agentkv.kernels import cpu_chunk_attention, cpu_paged_attention, reference
from agentkv.kernels.metadata import AttnMetadata
from tests.cpu_kernels import built_on_each_isa
from tests.test_kernel_cpu_paged_attention import DTYPES, TOL, build

# Every test on each vector ISA this CPU runs, with its kernels built for it (a failed build fails on x86).
_built = built_on_each_isa(cpu_chunk_attention, cpu_paged_attention)

# (page_size, (q heads, kv heads), head_dim, [(query_len, cached_len)], sliding_window, scattered pages)
CASES = [
    # SmolLM2's heads: a fresh chunk, chunks over a cache, a decode and a verify the kernel leaves
    # alone; 33 x 3 = 99 rows cross a row block, 200 x 3 = 600 end mid-block
    (16, (9, 3), 64, [(100, 0), (33, 200), (1, 50), (200, 77), (5, 20)], 0, True),
    # chunks ending on and either side of 64-key tiles; MHA, a whole block of 96 rows exactly
    (16, (2, 2), 64, [(64, 0), (65, 63), (48, 80), (96, 1)], 0, True),
    # pages smaller than a tile and of a tile; groups of 4 and 8
    (4, (8, 2), 64, [(40, 9), (70, 0)], 0, True),
    (64, (8, 1), 128, [(50, 30), (35, 129)], 0, False),
    # head_dim 16, 48, 80 (bf16 widened to fp32: not whole 32-lane words) and 32 (vdpbf16ps)
    (8, (4, 2), 16, [(40, 10), (90, 3)], 0, True),
    (16, (6, 3), 48, [(37, 60)], 0, True),
    (32, (10, 2), 80, [(41, 90), (34, 1)], 0, True),
    (16, (4, 4), 32, [(120, 33)], 0, True),
    # sliding windows: shorter than a tile, across tiles and row blocks, wider than the sequence
    (16, (9, 3), 64, [(100, 40), (40, 200)], 5, True),
    (4, (6, 3), 32, [(70, 64), (50, 0)], 37, True),
    (16, (4, 2), 64, [(80, 100)], 64, False),
    (16, (4, 2), 64, [(40, 20)], 500, True),
]
LONGER_THAN = 32  # sequences with at most this many queries are the decode kernel's


def case_id(c) -> str:
    return f"p{c[0]}-h{c[1][0]}:{c[1][1]}-d{c[2]}-w{c[4]}-{'scattered' if c[5] else 'consecutive'}"


def run(q, k_cache, v_cache, meta, scale, window=0, longer_than=LONGER_THAN) -> torch.Tensor:
    out = torch.full_like(q, 7.0)  # rows the kernel must not write keep this
    cpu_chunk_attention.chunk_attention_into(out, q, k_cache, v_cache, meta, scale, window, longer_than)
    return out


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_naive(case, dtype):
    q, k_cache, v_cache, meta = build(case, dtype)
    scale = case[2] ** -0.5
    got = run(q, k_cache, v_cache, meta, scale, case[4])
    want = reference.naive_paged_attention(q, k_cache, v_cache, meta, scale, case[4])
    start = 0
    for q_len in meta.query_lens_list:
        rows = slice(start, start + q_len)
        if q_len > LONGER_THAN:
            assert not got[rows].isnan().any()
            torch.testing.assert_close(got[rows].double(), want[rows], atol=TOL[dtype][0], rtol=TOL[dtype][1])
        else:
            assert (got[rows] == 7.0).all()
        start += q_len


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_the_decode_kernel_and_this_one_fill_one_step(dtype):
    q, k_cache, v_cache, meta = build(CASES[0], dtype)
    got = cpu_paged_attention.paged_attention(
        q, k_cache, v_cache, meta, 0.125, chunks=cpu_chunk_attention.chunk_attention_into
    )
    want = reference.naive_paged_attention(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype][0], rtol=TOL[dtype][1])


def _pool(k: torch.Tensor, v: torch.Tensor, table: list[int], num_pages: int, page_size: int):
    hkv, seq_len, d = k.shape
    k_cache = torch.zeros((hkv, num_pages, page_size, d), dtype=k.dtype).permute(1, 2, 0, 3)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.arange(seq_len)
    slots = torch.tensor(table)[pos // page_size] * page_size + pos % page_size
    reference._by_head(k_cache).index_copy_(1, slots, k)
    reference._by_head(v_cache).index_copy_(1, slots, v)
    return k_cache, v_cache


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("window", [0, 45])
@pytest.mark.parametrize("page_size", [8, 16])  # bf16 on pages of 16 runs on AMX where the CPU has it
def test_bits_do_not_depend_on_placement_batch_or_chunking(dtype, window, page_size):
    """A query's output is bit-identical wherever its sequence's pages lie,
    whatever shares the step, and however many queries its chunk holds
    before it (row blocks and tiles never mix rows' arithmetic)."""
    hq, hkv, d, seq_len = 9, 3, 64, 300
    g = torch.Generator().manual_seed(5)
    k = torch.randn(hkv, seq_len, d, generator=g).to(dtype)
    v = torch.randn(hkv, seq_len, d, generator=g).to(dtype)
    q = torch.randn(160, hq, d, generator=g).to(dtype)  # the last 160 positions' queries
    n = -(-seq_len // page_size)
    num_pages = 3 * n
    rng = random.Random(1)
    results = []
    for placement, chunk in enumerate((160, 160, 100, 41, 160)):
        table = list(range(n)) if placement == 0 else rng.sample(range(num_pages), n)
        k_cache, v_cache = _pool(k, v, table, num_pages, page_size)
        free = [p for p in range(num_pages) if p not in table]
        others = [(50, 90, free[:12]), (2, 30, free[12:16])] if placement % 2 else []
        q_all = torch.cat([torch.randn(a, hq, d, generator=g).to(dtype) for a, _, _ in others] + [q[-chunk:]])
        meta = AttnMetadata.build(
            [a for a, _, _ in others] + [chunk], [b for _, b, _ in others] + [seq_len],
            [t for _, _, t in others] + [table], page_size,
        )
        results.append(run(q_all, k_cache, v_cache, meta, d**-0.5, window, longer_than=1)[-chunk:])
    for r in results[1:]:
        assert torch.equal(r, results[0][-r.shape[0]:])


def test_dispatch_runs_the_chunk_kernel_for_long_sequences(monkeypatch):
    x = torch.zeros(3, 576)
    q, k_cache, v_cache, meta = build(CASES[0], torch.float32)
    chosen = dispatch.select(x, k_cache)
    assert chosen.paged_attention is dispatch._cpu_attention_with_chunks
    got = dispatch.paged_attention(q, k_cache, v_cache, meta, 0.125)
    want = cpu_paged_attention.paged_attention(q, k_cache, v_cache, meta, 0.125)  # chunks by the reference
    start = 0
    for q_len in meta.query_lens_list:
        rows = slice(start, start + q_len)
        if q_len > cpu_paged_attention.MAX_QUERIES[torch.float32]:
            assert torch.equal(got[rows], run(q, k_cache, v_cache, meta, 0.125)[rows])
            assert not torch.equal(got[rows], want[rows])  # the kernel's bits, not the reference's
        else:
            assert torch.equal(got[rows], want[rows])
        start += q_len


def test_a_failed_build_leaves_chunks_to_the_reference_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpu_chunk_attention.extension, "error", "building cpu_chunk_attention.cpp failed: no g++")
    monkeypatch.setattr(dispatch, "_warned_chunks", [])
    q, k_cache, v_cache, meta = build(CASES[0], torch.float32)
    with pytest.warns(RuntimeWarning, match="no g\\+\\+"):
        out = dispatch.paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(out, cpu_paged_attention.paged_attention(q, k_cache, v_cache, meta, 0.125))
    assert dispatch.select(torch.zeros(1, 576), k_cache).paged_attention is cpu_paged_attention.paged_attention
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.paged_attention(q, k_cache, v_cache, meta, 0.125)


@pytest.mark.parametrize("head_dim,dtype", [(24, torch.float32), (64, torch.float16), (144, torch.float32)])
def test_unsupported_shapes_are_refused(head_dim, dtype):
    q, k_cache, v_cache, meta = build((4, (2, 1), head_dim, [(40, 5)], 0, False), dtype)
    assert not cpu_chunk_attention.supports(q, k_cache)
    with pytest.raises(ValueError, match="head_dim"):
        run(q, k_cache, v_cache, meta, 0.1)


def test_bad_lengths_are_refused_and_write_nothing():
    q, k_cache, v_cache, meta = build((16, (2, 2), 32, [(40, 5)], 0, False), torch.float32)
    meta.seq_lens[0] = 30  # fewer keys than queries (AttnMetadata.build refuses that before the kernel would)
    out = torch.full_like(q, 7.0)
    with pytest.raises(RuntimeError, match="bad lengths"):
        cpu_chunk_attention.chunk_attention_into(out, q, k_cache, v_cache, meta, 0.1)
    assert (out == 7.0).all()
