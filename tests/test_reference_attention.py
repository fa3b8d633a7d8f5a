"""The torch paged attention (the CPU path and the kernels' oracle) against a
naive per-query softmax over gathered keys."""
from __future__ import annotations

import pytest
import torch

from agentkv.kernels import reference
from agentkv.kernels.metadata import AttnMetadata

# (page_size, (q heads, kv heads), head_dim, [(query_len, cached_len)], sliding_window, contiguous pages)
CASES = [
    (4, (2, 2), 16, [(1, 0), (3, 2), (5, 7), (1, 13), (6, 0)], 0, False),
    (16, (8, 2), 64, [(1, 40), (7, 9), (20, 3), (1, 0), (33, 64)], 0, True),
    (16, (8, 2), 64, [(17, 200), (40, 0), (1, 150)], 0, False),
    (8, (10, 2), 80, [(12, 16), (9, 0), (8, 8)], 0, True),
    (8, (6, 1), 24, [(5, 20), (30, 3)], 0, False),
    (4, (4, 1), 24, [(1, 30), (9, 6), (12, 0)], 5, True),
    (16, (8, 1), 64, [(1, 100), (17, 40), (3, 2)], 24, False),
]


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec, scale: float, window: int) -> torch.Tensor:
    """q [T, Hq, D]; k, v per sequence [L, Hkv, D] in position order."""
    out = torch.empty_like(q)
    t = 0
    for (q_len, cached), ks, vs in zip(spec, k, v):
        group = q.shape[1] // ks.shape[1]
        for i in range(q_len):
            pos = cached + i
            lo = max(0, pos - window + 1) if window else 0
            kk = ks[lo : pos + 1].repeat_interleave(group, dim=1)  # [n, Hq, D]
            vv = vs[lo : pos + 1].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,nhd->hn", q[t].double(), kk.double()) * scale
            out[t] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vv.double()).to(q.dtype)
            t += 1
    return out


def build(case, dtype: torch.dtype = torch.float32):
    """A paged cache holding random keys for each sequence of the case, its
    metadata, the queries, and the keys and values in position order."""
    page_size, (hq, hkv), d, spec, window, contiguous = case
    g = torch.Generator().manual_seed(1)
    seq_lens = [q + c for q, c in spec]
    pages = [-(-s // page_size) for s in seq_lens]
    total = sum(pages) + 2
    order = list(range(total)) if contiguous else torch.randperm(total, generator=g).tolist()
    tables, start = [], 0
    for n in pages:
        tables.append(order[start : start + n])
        start += n
    meta = AttnMetadata.build([q for q, _ in spec], seq_lens, tables, page_size)
    k_cache = torch.full((total, page_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    ks, vs = [], []
    for table, s_len in zip(tables, seq_lens):
        kk = torch.randn(s_len, hkv, d, generator=g).to(dtype)
        vv = torch.randn(s_len, hkv, d, generator=g).to(dtype)
        for pos in range(s_len):
            k_cache[table[pos // page_size], pos % page_size] = kk[pos]
            v_cache[table[pos // page_size], pos % page_size] = vv[pos]
        ks.append(kk)
        vs.append(vv)
    q = torch.randn(sum(q for q, _ in spec), hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, meta, ks, vs


def case_id(c) -> str:
    return f"p{c[0]}-h{c[1][0]}:{c[1][1]}-d{c[2]}-w{c[4]}-{'consecutive' if c[5] else 'scattered'}"


@pytest.mark.parametrize("key_block", [None, 8], ids=["default-key-block", "key-block-8"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reference_matches_naive(case, key_block, monkeypatch):
    if key_block:  # smaller than most sequences here: several logical key blocks each
        monkeypatch.setattr(reference, "KEY_BLOCK", key_block)
    q, k_cache, v_cache, meta, ks, vs = build(case)
    scale = case[2] ** -0.5
    got = reference.paged_attention(q, k_cache, v_cache, meta, scale, case[4])
    torch.testing.assert_close(got, naive(q, ks, vs, case[3], scale, case[4]), atol=2e-5, rtol=2e-5)


# bf16 on CPU takes its own matmul paths (per-KV-head pieces, blocked chunks).
# Shrunk thresholds send these small cases through them, across block
# boundaries (query blocks and logical key blocks); the last case is
# full-size at the default thresholds.
BF16_CASES = CASES + [(16, (9, 3), 64, [(1, 1500), (300, 1200), (16, 2000)], 0, False)]


@pytest.mark.parametrize("shrunk", [True, False], ids=["shrunk-thresholds", "default-thresholds"])
@pytest.mark.parametrize("case", BF16_CASES, ids=case_id)
def test_reference_bf16_matches_naive(case, shrunk, monkeypatch):
    if shrunk:
        monkeypatch.setattr(reference, "PER_HEAD_MIN_KEYS", 1)
        monkeypatch.setattr(reference, "BF16_BLOCK_ROWS", 8)
        monkeypatch.setattr(reference, "KEY_BLOCK", 8)
    q, k_cache, v_cache, meta, ks, vs = build(case, torch.bfloat16)
    scale = case[2] ** -0.5
    got = reference.paged_attention(q, k_cache, v_cache, meta, scale, case[4])
    # bf16 rounds the scores (as HF's eager bf16 attention does) and the output.
    torch.testing.assert_close(got, naive(q, ks, vs, case[3], scale, case[4]), atol=3e-2, rtol=3e-2)
