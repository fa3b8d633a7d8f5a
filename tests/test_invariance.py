"""Bit-exact invariance on CPU: a sequence's results do not depend on where
its KV pages sit in the pool, nor on what else shares its step."""
from __future__ import annotations

import random

import pytest
import torch

from agentkv.cache.pool import PagePool
from agentkv.kernels import reference
from agentkv.kernels.metadata import AttnMetadata
from agentkv.model import packed_linear
from agentkv.model.config import ModelConfig
from agentkv.model.default import random_init
from agentkv.model.llama import Transformer


def placements(n: int, num_pages: int, seed: int) -> dict[str, list[int]]:
    """n page ids out of num_pages (>= 2n + 8) in physically different orders."""
    rng = random.Random(seed)
    tail = list(range(n // 2, n))
    return {
        "consecutive": list(range(3, 3 + n)),
        "reversed": list(range(3 + n, 3, -1)),
        "interleaved": list(range(1, 2 * n + 1, 2)),
        "random": rng.sample(range(num_pages), n),
        # Consecutive but for one page moved away, then a run elsewhere.
        "partly-consecutive": [p + 2 for p in range(n // 2)] + [num_pages - 1] + [p + n for p in tail[1:]],
    }


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """q [Δ, Hq, D] at the end of keys k, v [L, Hkv, D], in fp64."""
    num_q, group, num_keys = q.shape[0], q.shape[1] // k.shape[1], k.shape[0]
    kk, vv = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    q_pos = torch.arange(num_keys - num_q, num_keys)[:, None]
    k_pos = torch.arange(num_keys)[None, :]
    visible = k_pos <= q_pos
    if window:
        visible &= k_pos > q_pos - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, vv)


# (page_size, key block, seq_len, query_lens, sliding window): lengths off
# page multiples, crossing block boundaries (the block shrunk, or not).
ATTN_CASES = [
    (4, 12, 45, (1, 2, 7, 16, 17, 30), 0),
    (4, 12, 10, (1, 5, 10), 0),  # one block, shorter than a block
    (4, 8, 37, (1, 9, 20), 11),
    (16, reference.KEY_BLOCK, 4100, (1, 3, 17), 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"p{c[0]}-kb{c[1]}-L{c[2]}-w{c[4]}")
def test_attention_is_placement_invariant(case, dtype, monkeypatch):
    page_size, key_block, seq_len, query_lens, window = case
    monkeypatch.setattr(reference, "KEY_BLOCK", key_block)
    if dtype == torch.bfloat16:
        monkeypatch.setattr(reference, "BF16_BLOCK_ROWS", 8)
    hq, hkv, d = 6, 2, 32
    n = -(-seq_len // page_size)
    num_pages = 2 * n + 8
    g = torch.Generator().manual_seed(seq_len)
    k = torch.randn(seq_len, hkv, d, generator=g).to(dtype)
    v = torch.randn(seq_len, hkv, d, generator=g).to(dtype)
    scale = d**-0.5
    caches = {}
    for name, table in placements(n, num_pages, seq_len).items():
        # Head-major, as the pool stores it; slots the sequence does not own
        # hold NaN, so a stray read shows.
        k_cache = torch.full((hkv, num_pages, page_size, d), float("nan"), dtype=dtype).permute(1, 2, 0, 3)
        v_cache = torch.full_like(k_cache, float("nan"))
        pos = torch.arange(seq_len)
        slots = torch.tensor(table)[pos // page_size] * page_size + pos % page_size
        reference._by_head(k_cache).index_copy_(1, slots, k.transpose(0, 1))
        reference._by_head(v_cache).index_copy_(1, slots, v.transpose(0, 1))
        caches[name] = table, k_cache, v_cache
    for q_len in query_lens:
        q = torch.randn(q_len, hq, d, generator=g).to(dtype)
        outs = {
            name: reference.paged_attention(
                q, k_cache, v_cache, AttnMetadata.build([q_len], [seq_len], [table], page_size), scale, window
            )
            for name, (table, k_cache, v_cache) in caches.items()
        }
        first = outs["consecutive"]
        for name, out in outs.items():
            assert torch.equal(out, first), f"q_len {q_len}: {name} differs from consecutive"
        tol = 2e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(first.double(), naive(q, k, v, scale, window), atol=tol, rtol=tol)


# A small model whose MLP down projection has 1536 inputs: from there a
# single fp32 row in oneDNN sums differently from two or more (model.llama.linear).
TINY = dict(
    vocab_size=512, hidden_size=128, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
)
PAGE_SIZE = 4
PROMPT = 37  # the sequence under test: its prompt, then one more step
OTHERS = [(20, 1), (9, 6), (0, 17)]  # other sequences: (prompt, next step)


def _step(model, pool, seqs: list[tuple[list[int], list[int], int]]) -> list[torch.Tensor]:
    """One forward over seqs (tokens, pages, cached length); each one's logits."""
    meta = AttnMetadata.build(
        [len(t) for t, _, _ in seqs], [c + len(t) for t, _, c in seqs], [p for _, p, _ in seqs], pool.page_size
    )
    ids = torch.tensor([x for t, _, _ in seqs for x in t])
    return list(model(ids, meta, pool.kv).split([len(t) for t, _, _ in seqs]))


def _run(model, step_len: int, table: list[int], others: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence under test, its pages at table: its prompt, then step_len
    tokens, alone or alongside the other sequences in both steps. Returns its
    logits of both steps."""
    cfg = model.cfg
    pool = PagePool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, PAGE_SIZE, model.dtype)
    # Placements are chosen by hand, so no page is taken from the free list.
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (PROMPT + step_len,), generator=g).tolist()
    first = [(tokens[:PROMPT], table, 0)]
    second = [(tokens[PROMPT:], table, PROMPT)]
    if others:
        free = [p for p in range(pool.num_pages) if p not in table]
        for prompt_len, next_len in OTHERS:
            n = -(-(prompt_len + next_len) // PAGE_SIZE)
            pages, free = free[:n], free[n:]
            other = torch.randint(0, cfg.vocab_size, (prompt_len + next_len,), generator=g).tolist()
            if prompt_len:
                first.append((other[:prompt_len], pages, 0))
            # Ahead of the sequence under test: its rows move.
            second.insert(0, (other[prompt_len:], pages, prompt_len))
    return _step(model, pool, first)[0], _step(model, pool, second)[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [0, 13], ids=["full", "window13"])
@pytest.mark.parametrize("step_len", [1, 5, 20], ids=["decode", "verify", "chunk"])
def test_model_logits_do_not_depend_on_batch_or_placement(step_len, window, dtype, monkeypatch):
    if not packed_linear.supported(dtype, torch.device("cpu")):
        pytest.skip(f"row-invariant linears need oneDNN to run {dtype}")
    monkeypatch.setattr(reference, "KEY_BLOCK", 16)  # the sequence spans several key blocks
    cfg = dict(TINY, model_type="mistral", sliding_window=window) if window else dict(TINY, model_type="llama")
    model = Transformer(ModelConfig.from_hf(cfg), dtype)
    random_init(model, 0)
    model.prepack()
    n = -(-(PROMPT + step_len) // PAGE_SIZE)
    tables = placements(n, 64, step_len)
    alone = _run(model, step_len, tables["consecutive"], others=False)
    for name, table in tables.items():
        for others in (False, True):
            got = _run(model, step_len, table, others)
            for a, b in zip(got, alone):
                assert torch.equal(a, b), f"{name} placement, others={others}"


def build_with_loop(query_lens, seq_lens, block_tables, page_size):
    """AttnMetadata.build's per-token fields as a Python loop (the oracle)."""
    positions, slots = [], []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
        for pos in range(s_len - q_len, s_len):
            positions.append(pos)
            slots.append(table[pos // page_size] * page_size + pos % page_size)
    cu = [0]
    for q_len in query_lens:
        cu.append(cu[-1] + q_len)
    width = max(len(t) for t in block_tables)
    return cu, positions, slots, [t + [0] * (width - len(t)) for t in block_tables]


@pytest.mark.parametrize("seed", range(20))
def test_metadata_build_matches_loop(seed):
    rng = random.Random(seed)
    page_size = rng.choice([1, 4, 16])
    query_lens, seq_lens, tables = [], [], []
    for _ in range(rng.randint(1, 8)):
        q_len = rng.choice([1, 1, rng.randint(2, 8), rng.randint(9, 70)])
        s_len = q_len + rng.choice([0, rng.randint(0, 100)])
        query_lens.append(q_len)
        seq_lens.append(s_len)
        tables.append([rng.randrange(500) for _ in range(-(-s_len // page_size) + rng.randint(0, 2))])
    meta = AttnMetadata.build(query_lens, seq_lens, tables, page_size)
    cu, positions, slots, padded = build_with_loop(query_lens, seq_lens, tables, page_size)
    expect = {
        "cu_seqlens_q": torch.tensor(cu, dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_tables": torch.tensor(padded, dtype=torch.int32),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "positions": torch.tensor(positions, dtype=torch.int64),
    }
    for name, want in expect.items():
        got = getattr(meta, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert meta.query_lens_list == query_lens and meta.seq_lens_list == seq_lens and meta.page_size == page_size


@pytest.mark.parametrize(
    "args",
    [
        ([], [], [], 4),
        ([1, 2], [3], [[0]], 4),
        ([0], [3], [[0]], 4),
        ([4], [3], [[0]], 4),
        ([1], [9], [[0, 1]], 4),
    ],
    ids=["empty", "ragged-lists", "no-queries", "query-past-seq", "short-table"],
)
def test_metadata_build_rejects_bad_input(args):
    with pytest.raises(ValueError):
        AttnMetadata.build(*args)
