"""The CPU decode/verify attention kernel (kernels/cpu_paged_attention.py)
against the naive fp64 softmax oracle, over ragged batches, page boundaries,
GQA ratios, sliding windows and both dtypes, with the split shrunk so that
sequences span several splits and tiles straddle page and split edges."""
from __future__ import annotations

import random
import shutil
import subprocess
import time
import warnings

import pytest
import torch

from agentkv.kernels import dispatch
from agentkv.kernels import cpu_paged_attention, reference
from agentkv.kernels.metadata import AttnMetadata
from tests.cpu_kernels import built_on_each_isa

# Every test on each vector ISA this CPU runs, with its kernels built for it (a failed build fails on x86).
_built = built_on_each_isa(cpu_paged_attention)

# (page_size, (q heads, kv heads), head_dim, [(query_len, cached_len)], sliding_window, scattered pages)
CASES = [
    # decode steps, lengths on and off page and tile edges, MHA; head_dim 16 and 80 (not
    # whole 32-lane bf16 words) take bf16 widened to fp32, the others vdpbf16ps where the CPU has it
    (16, (2, 2), 16, [(1, 0), (1, 15), (1, 16), (1, 31), (1, 47)], 0, True),
    # SmolLM2's heads; verify steps (k+1) next to decodes, a mixed step with a prefill chunk
    (16, (9, 3), 64, [(1, 100), (5, 60), (17, 30), (16, 0), (3, 2)], 0, True),
    # pages smaller than a tile: a tile reads several pages
    (4, (8, 2), 64, [(1, 37), (4, 9), (2, 0), (9, 50)], 0, True),
    (8, (4, 1), 128, [(1, 70), (7, 25)], 0, False),
    # head_dim of 5 vectors, group of 5
    (32, (10, 2), 80, [(1, 90), (6, 33), (1, 1)], 0, True),
    # sliding windows: shorter than a tile, across splits, wider than the sequence
    (16, (8, 2), 64, [(1, 100), (5, 40), (1, 3), (12, 70)], 5, True),
    (4, (6, 3), 32, [(1, 130), (3, 64), (20, 10)], 37, True),
    (16, (4, 2), 64, [(2, 20), (1, 9)], 64, False),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# bf16: the kernel takes q.K and p.V on vdpbf16ps where the CPU has it, with p
# rounded to bf16 as flash attention does on GPUs; its error over these cases
# (at most 7.7e-3) is that of rounding the exact result to bf16 alone, so the
# bound is two bf16 ulps (2 * 2^-8 relative) plus a little for outputs near 0.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (4e-3, 2 * 2**-8)}


def build(case, dtype: torch.dtype, seed: int = 0):
    """A pool of random K/V (NaN in every slot no sequence owns, so a stray
    read shows), the step's metadata and queries."""
    page_size, (hq, hkv), d, spec, _, scattered = case
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in spec]
    pages = [-(-s // page_size) for s in seq_lens]
    total = sum(pages) + 3
    order = torch.randperm(total, generator=g).tolist() if scattered else list(range(total))
    tables, start = [], 0
    for n in pages:
        tables.append(order[start : start + n])
        start += n
    meta = AttnMetadata.build([q for q, _ in spec], seq_lens, tables, page_size)
    # Head-major, as the pool stores it.
    k_cache = torch.full((hkv, total, page_size, d), float("nan"), dtype=dtype).permute(1, 2, 0, 3)
    v_cache = torch.full_like(k_cache, float("nan"))
    for table, s_len in zip(tables, seq_lens):
        pos = torch.arange(s_len)
        slots = torch.tensor(table)[pos // page_size] * page_size + pos % page_size
        reference._by_head(k_cache).index_copy_(1, slots, torch.randn(hkv, s_len, d, generator=g).to(dtype))
        reference._by_head(v_cache).index_copy_(1, slots, torch.randn(hkv, s_len, d, generator=g).to(dtype))
    q = torch.randn(sum(q for q, _ in spec), hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, meta


def case_id(c) -> str:
    return f"p{c[0]}-h{c[1][0]}:{c[1][1]}-d{c[2]}-w{c[4]}-{'scattered' if c[5] else 'consecutive'}"


def use_prefetch(monkeypatch, tiles: int) -> None:
    """Every later call of the kernel prefetches `tiles` tiles ahead (0: none)."""
    monkeypatch.setenv(cpu_paged_attention.PREFETCH_ENV, str(tiles))
    cpu_paged_attention.tune_prefetch([], 1)
    assert cpu_paged_attention.prefetch_tiles() == tiles


@pytest.fixture(autouse=True)
def keep_tuning(monkeypatch):
    monkeypatch.setattr(cpu_paged_attention, "_tuning", cpu_paged_attention.tuning())
    monkeypatch.setattr(cpu_paged_attention, "_tuned_pool", ())


@pytest.mark.parametrize("prefetch", cpu_paged_attention.PREFETCH_CHOICES, ids=lambda p: f"prefetch{p}")
@pytest.mark.parametrize("split", [16, 32, cpu_paged_attention.SPLIT], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_naive(case, dtype, split, prefetch, monkeypatch):
    use_prefetch(monkeypatch, prefetch)
    monkeypatch.setattr(cpu_paged_attention, "SPLIT", split)
    # Up to 16 queries here in both dtypes; the 17- and 20-query chunks take the reference.
    monkeypatch.setitem(cpu_paged_attention.MAX_QUERIES, dtype, 16)
    q, k_cache, v_cache, meta = build(case, dtype)
    scale = case[2] ** -0.5
    got = cpu_paged_attention.paged_attention(q, k_cache, v_cache, meta, scale, case[4])
    assert got.dtype == dtype and got.shape == q.shape and not got.isnan().any()
    want = reference.naive_paged_attention(q, k_cache, v_cache, meta, scale, case[4])
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("max_queries", [1, 4])
def test_longer_sequences_go_to_the_reference(max_queries, monkeypatch):
    """Below the threshold the kernel, above it the reference, in one step."""
    monkeypatch.setitem(cpu_paged_attention.MAX_QUERIES, torch.float32, max_queries)
    case = CASES[1]
    q, k_cache, v_cache, meta = build(case, torch.float32)
    got = cpu_paged_attention.paged_attention(q, k_cache, v_cache, meta, 0.125)
    want = reference.naive_paged_attention(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    start = 0
    for q_len in meta.query_lens_list:
        rows = slice(start, start + q_len)
        if q_len > max_queries:  # the reference's own bits
            assert torch.equal(got[rows], reference.paged_attention(q, k_cache, v_cache, meta, 0.125)[rows])
        start += q_len


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("window", [0, 21])
def test_bits_do_not_depend_on_placement_or_batch(dtype, window, monkeypatch):
    """A sequence's output is bit-identical wherever its pages lie and
    whatever shares its step (splits are logical, never chosen by load)."""
    monkeypatch.setattr(cpu_paged_attention, "SPLIT", 32)
    monkeypatch.setitem(cpu_paged_attention.MAX_QUERIES, dtype, 16)
    page_size, hq, hkv, d, seq_len = 4, 6, 2, 32, 150
    g = torch.Generator().manual_seed(3)
    k = torch.randn(hkv, seq_len, d, generator=g).to(dtype)
    v = torch.randn(hkv, seq_len, d, generator=g).to(dtype)
    n = -(-seq_len // page_size)
    num_pages = 3 * n
    rng = random.Random(0)
    outs = []
    for q_len in (1, 5):
        q = torch.randn(q_len, hq, d, generator=g).to(dtype)
        results = []
        for placement in range(4):
            table = list(range(n)) if placement == 0 else rng.sample(range(num_pages), n)
            k_cache = torch.full((hkv, num_pages, page_size, d), float("nan"), dtype=dtype).permute(1, 2, 0, 3)
            v_cache = torch.full_like(k_cache, float("nan"))
            pos = torch.arange(seq_len)
            slots = torch.tensor(table)[pos // page_size] * page_size + pos % page_size
            reference._by_head(k_cache).index_copy_(1, slots, k)
            reference._by_head(v_cache).index_copy_(1, slots, v)
            free = [p for p in range(num_pages) if p not in table]
            # Alone, then behind other sequences of other lengths (pages from the free ones).
            others = [(3, 40, free[:10]), (1, 17, free[10:15])] if placement % 2 else []
            q_all = torch.cat([torch.randn(a, hq, d, generator=g).to(dtype) for a, _, _ in others] + [q])
            meta = AttnMetadata.build(
                [a for a, _, _ in others] + [q_len], [b for _, b, _ in others] + [seq_len],
                [t for _, _, t in others] + [table], page_size,
            )
            k_cache.nan_to_num_(0.0)  # the other sequences' slots hold zeros
            v_cache.nan_to_num_(0.0)
            results.append(cpu_paged_attention.paged_attention(q_all, k_cache, v_cache, meta, d**-0.5, window)[-q_len:])
        for r in results[1:]:
            assert torch.equal(r, results[0])
        outs.append(results[0])
    assert outs[0].shape == (1, hq, d) and outs[1].shape == (5, hq, d)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("head_dim", [32, 64])
def test_sequences_sharing_prefix_pages_get_their_bits_alone(dtype, head_dim, monkeypatch):
    """Sequences whose tables hold the same pages for a prefix (the radix
    cache's sharing) each get the bits they get alone in the step and the
    naive result, over every kind of overlap: a prefix held by 26 decodes,
    verifies beside decodes, a sequence whose last shared split holds its own
    query, one that shares only part of a split, one with the same keys in
    other pages, and a longer chunk that goes elsewhere. (A kernel that read
    shared splits once for all their sequences broke this by one block
    size's rounding; see docs/bench_cpu_attention.md, round 7.)"""
    monkeypatch.setattr(cpu_paged_attention, "SPLIT", 32)
    monkeypatch.setitem(cpu_paged_attention.MAX_QUERIES, dtype, 16)
    page_size, hq, hkv = 4, 6, 2
    g = torch.Generator().manual_seed(5)
    prefix = 104  # 26 pages, 3 whole splits and a part
    # (queries, length, tokens of the shared prefix its table holds)
    spec = [(1, 150 + i, prefix) for i in range(26)] + [
        (5, 140, prefix), (3, 130, prefix), (1, 97, prefix), (2, 70, prefix), (1, 130, 40), (1, 130, 0), (20, 120, prefix),
    ]
    tables, next_page = [], -(-prefix // page_size)
    for _, s_len, shared in spec:
        held = min(shared // page_size, -(-s_len // page_size))  # a sequence inside the prefix ends in its pages
        own = -(-s_len // page_size) - held
        tables.append(list(range(held)) + list(range(next_page, next_page + own)))
        next_page += own
    k_cache = torch.zeros(hkv, next_page, page_size, head_dim, dtype=dtype).permute(1, 2, 0, 3)
    v_cache = torch.zeros_like(k_cache)
    base_k = torch.randn(hkv, 200, head_dim, generator=g).to(dtype)
    base_v = torch.randn(hkv, 200, head_dim, generator=g).to(dtype)
    for i, ((_, s_len, _), table) in enumerate(zip(spec, tables)):
        pos = torch.arange(s_len)
        slots = torch.tensor(table)[pos // page_size] * page_size + pos % page_size
        # The prefix's keys for all (written again, the same, where shared); the rest each its own.
        k = torch.randn(hkv, s_len, head_dim, generator=g).to(dtype)
        v = torch.randn(hkv, s_len, head_dim, generator=g).to(dtype)
        k[:, :prefix], v[:, :prefix] = base_k[:, : min(prefix, s_len)], base_v[:, : min(prefix, s_len)]
        reference._by_head(k_cache).index_copy_(1, slots, k)
        reference._by_head(v_cache).index_copy_(1, slots, v)
    q = torch.randn(sum(n for n, _, _ in spec), hq, head_dim, generator=g).to(dtype)
    meta = AttnMetadata.build([n for n, _, _ in spec], [s for _, s, _ in spec], tables, page_size)
    scale = head_dim**-0.5
    got = cpu_paged_attention.paged_attention(q, k_cache, v_cache, meta, scale)
    want = reference.naive_paged_attention(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    start = 0
    for (n, s_len, _), table in zip(spec, tables):
        alone = AttnMetadata.build([n], [s_len], [table], page_size)
        rows = slice(start, start + n)
        assert torch.equal(got[rows], cpu_paged_attention.paged_attention(q[rows], k_cache, v_cache, alone, scale))
        start += n


def test_dispatch_runs_the_kernel_on_cpu_and_env_forces_the_reference(monkeypatch):
    q, k_cache, v_cache, meta = build(CASES[1], torch.bfloat16)
    kernel = cpu_paged_attention.paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(dispatch.paged_attention(q, k_cache, v_cache, meta, 0.125), kernel)
    monkeypatch.setenv("AGENTKV_KERNELS", "torch")
    forced = dispatch.paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(forced, reference.paged_attention(q, k_cache, v_cache, meta, 0.125))
    assert not torch.equal(forced, kernel)  # a different path, not the same bits by accident


def test_a_failed_build_falls_back_to_the_reference_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpu_paged_attention.extension, "error", "building cpu_paged_attention.cpp failed: no g++")
    monkeypatch.setattr(dispatch, "_warned", [])
    q, k_cache, v_cache, meta = build(CASES[0], torch.float32)
    with pytest.warns(RuntimeWarning, match="no g\\+\\+"):
        out = dispatch.paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert torch.equal(out, reference.paged_attention(q, k_cache, v_cache, meta, 0.25))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.paged_attention(q, k_cache, v_cache, meta, 0.25)
    with pytest.raises(cpu_paged_attention.CpuKernelUnavailable, match="no g\\+\\+"):
        cpu_paged_attention.paged_attention(q, k_cache, v_cache, meta, 0.25)


@pytest.mark.parametrize("head_dim,dtype", [(24, torch.float32), (64, torch.float16), (144, torch.float32)])
def test_unsupported_shapes_are_refused_and_dispatched_to_the_reference(head_dim, dtype):
    case = (4, (2, 1), head_dim, [(1, 5)], 0, False)
    q, k_cache, v_cache, meta = build(case, dtype)
    assert not cpu_paged_attention.supports(q, k_cache)
    with pytest.raises(ValueError, match="head_dim"):
        cpu_paged_attention.paged_attention(q, k_cache, v_cache, meta, 0.1)
    assert torch.equal(dispatch.paged_attention(q, k_cache, v_cache, meta, 0.1),
                       reference.paged_attention(q, k_cache, v_cache, meta, 0.1))


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
def test_the_built_kernel_prefetches():
    # GCC once compiled every prefetch of this kernel away, silently: it ran
    # 1.6-2.7x slower on a pool in memory and no result showed it.
    ext = cpu_paged_attention.extension
    lib = ext.build_directory() / f"{ext.build_name()}.so"
    disassembly = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "prefetcht0" in disassembly


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[5]], ids=case_id)
def test_the_prefetch_distance_does_not_change_a_bit(case, dtype, monkeypatch):
    monkeypatch.setattr(cpu_paged_attention, "SPLIT", 32)
    q, k_cache, v_cache, meta = build(case, dtype)
    outs = []
    for tiles in (0, 1, 2, 5, cpu_paged_attention.MAX_PREFETCH):
        use_prefetch(monkeypatch, tiles)
        outs.append(cpu_paged_attention.paged_attention(q, k_cache, v_cache, meta, 0.125, case[4]))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_a_prefetch_distance_out_of_range_is_refused():
    q, k_cache, v_cache, meta = build(CASES[0], torch.float32)
    op = cpu_paged_attention.extension.load()
    out = torch.zeros_like(q)
    for tiles in (-1, cpu_paged_attention.MAX_PREFETCH + 1):
        with pytest.raises(RuntimeError, match="prefetch must be"):
            op(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, 0.25, 0, 32, 512, tiles, out)
    assert not out.any()


def tuning_pool(layers: int = 3, pages: int = 40, dtype=torch.float32):
    kv = torch.randn(layers, 2, 2, pages, 16, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    return kv, [(kv[i, 0].permute(1, 2, 0, 3), kv[i, 1].permute(1, 2, 0, 3)) for i in range(layers)]


def test_tuning_keeps_the_faster_choice_measured_on_the_pool(monkeypatch):
    """Each choice is timed over the given caches (within the budget) and the
    faster kept: here one choice is made slower on purpose, each way round.
    The pool is only read, and the global RNG is left alone."""
    monkeypatch.delenv(cpu_paged_attention.PREFETCH_ENV, raising=False)
    kv, caches = tuning_pool()
    before, rng = kv.clone(), torch.get_rng_state()
    real = cpu_paged_attention.extension.load()
    calls = []
    for slow in cpu_paged_attention.PREFETCH_CHOICES:
        def op(*args, slow=slow):
            calls.append((args[1].data_ptr(), int(args[4].max()), args[-2]))
            if args[-2] == slow:
                time.sleep(0.003)
            return real(*args)
        monkeypatch.setattr(cpu_paged_attention.extension, "load", lambda: op)
        budget = 20 * 2 * 16 * 2 * 32 * 4  # 20 pages of K and V of one layer
        t = cpu_paged_attention.tune_prefetch(caches, 4, budget_bytes=budget, repeats=3)
        assert t.tiles != slow and cpu_paged_attention.prefetch_tiles() == t.tiles
        assert set(t.ms) == set(cpu_paged_attention.PREFETCH_CHOICES) and t.ms[slow] > t.ms[t.tiles]
        assert (t.layers, t.keys, t.threads) == (1, 320, torch.get_num_threads())
        # Only the first layer was read, over the 320 keys of its first 20 pages.
        assert {c[0] for c in calls} == {caches[0][0].data_ptr()} and {c[1] for c in calls} == {320}
        calls.clear()
        # The same pool again: the choice stands, untimed.
        assert cpu_paged_attention.tune_prefetch(caches, 4, budget_bytes=budget, repeats=3) is t and not calls
        monkeypatch.setattr(cpu_paged_attention, "_tuned_pool", ())
    t = cpu_paged_attention.tune_prefetch(caches, 4, repeats=1)  # the default budget holds the whole pool
    assert (t.layers, t.keys) == (3, 640) and {c[0] for c in calls} == {k.data_ptr() for k, _ in caches}
    assert torch.equal(kv, before) and torch.equal(torch.get_rng_state(), rng)


def test_the_environment_fixes_the_choice_without_timing(monkeypatch):
    monkeypatch.setenv(cpu_paged_attention.PREFETCH_ENV, "1")
    monkeypatch.setattr(cpu_paged_attention.extension, "load", lambda: pytest.fail("timed"))
    t = cpu_paged_attention.tune_prefetch(tuning_pool()[1], 4)
    assert t.tiles == 1 and t.ms == {} and cpu_paged_attention.prefetch_tiles() == 1


@pytest.mark.parametrize("value", ["x", "-1", "17", "2.5", ""])
def test_a_bad_environment_value_is_refused_and_changes_nothing(value, monkeypatch):
    monkeypatch.setenv(cpu_paged_attention.PREFETCH_ENV, value)
    before = cpu_paged_attention.tuning()
    with pytest.raises(ValueError, match=cpu_paged_attention.PREFETCH_ENV):
        cpu_paged_attention.tune_prefetch(tuning_pool()[1], 4)
    assert cpu_paged_attention.tuning() is before
