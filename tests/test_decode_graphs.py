"""Fixed-shape decode and verify steps (engine/decode_graphs.py): what a CUDA
graph replays, run here by their eager equivalents over the same buffers and
buckets. The reference is the ordinary eager step of a twin engine: the same
greedy tokens, the same logits and the same K/V in every real page, with the
padding sequences' writes confined to the scratch page; the buffers never
move, and the keys stay few."""
from __future__ import annotations

import random

import pytest
import torch

from agentkv.cache.block_table import BlockTable
from agentkv.cache.pool import PagePool
from agentkv import Engine
from agentkv.engine.decode_graphs import MAX_QUERY, MIN_SEQ_BUCKET, DecodeGraphs
from agentkv.engine.limits import Limits
from agentkv.engine.step_item import StepItem
from tests.hf_models import make_hf_model

PS = 4
FIELDS = ("cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping", "positions")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("decode-graphs")
    make_hf_model("llama-gqa-llama3rope-tied", path, seed=5)
    return path


def _engine(ckpt, graphs: bool) -> Engine:
    # Prompt lookup: it drafts from the session alone, so twins draft alike.
    return Engine.from_pretrained(ckpt, page_size=PS, num_pages=512, prefix_cache=False, drafter="ngram",
                                  limits=Limits(prefill_chunk=16, max_num_batched_tokens=64), decode_graphs=graphs)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    phrases = [[rng.randrange(320) for _ in range(5)] for _ in range(3)]
    return [t for _ in range(rng.randint(3, 7)) for t in rng.choice(phrases)] + [rng.randrange(320)]


def _round(engine: Engine) -> dict[int, tuple[list[int], torch.Tensor]]:
    """Eight sessions, two of them joining late, decoding side by side
    (batches of 1 to 8: padded to 1, 2, 4 and 8) and leaving one by one; then
    one more speculates alone (a verify beside decodes is a mixed step, run
    eagerly). Each one's tokens and the logits of one more token."""
    sessions = {i: engine.session() for i in range(9)}
    reqs, out = {}, {}
    for i in range(6):
        sessions[i].queue(_prompt(i))
        reqs[i] = sessions[i].start_generate(max_tokens=6 + 4 * i, ignore_eos=True, speculative=False)
    for _ in range(4):
        engine.scheduler.step()
    for i in (6, 7):
        sessions[i].queue(_prompt(i))
        reqs[i] = sessions[i].start_generate(max_tokens={6: 10, 7: 14}[i], ignore_eos=True, speculative=False)
    for i in range(8):
        engine.scheduler.wait(reqs[i])
    sessions[8].queue(_prompt(8))
    reqs[8] = sessions[8].start_generate(max_tokens=24, ignore_eos=True, speculative=True)
    engine.scheduler.wait(reqs[8])
    for i, s in sessions.items():
        out[i] = (list(s.tokens), s.append([7]))
        s.close()
    return out


def test_fixed_shape_steps_compute_what_eager_steps_do(ckpt):
    eager, fixed = _engine(ckpt, False), _engine(ckpt, True)
    graphs = fixed.runner.graphs
    assert eager.runner.graphs is None and graphs is not None and not graphs.capture
    allocations = graphs.buffers.allocations
    pointers = set()
    build = graphs.buffers.build

    def recording_build(*args, **kwargs):
        meta = build(*args, **kwargs)
        pointers.add(tuple(getattr(meta, name).data_ptr() for name in FIELDS))
        return meta

    graphs.buffers.build = recording_build
    want, got = _round(eager), _round(fixed)
    for i in want:
        assert got[i][0] == want[i][0], f"session {i}: greedy tokens differ"
        assert torch.equal(got[i][1], want[i][1]), f"session {i}: logits differ"
    n = eager.pool.num_pages
    assert torch.equal(fixed.pool.kv[:, :, :n], eager.pool.kv[:, :, :n]), "a real page's K/V differs"
    assert fixed.pool.kv[:, :, n].abs().sum() > 0, "no padding sequence wrote the scratch page"
    assert not eager.pool.kv[:, :, n].any()

    batches = {seqs for seqs, _, _ in graphs.keys}
    assert {1, 2, 4, 8} <= batches, f"batch buckets run: {sorted(batches)}"
    assert any(q == 1 for _, q, _ in graphs.keys) and any(q > 1 for _, q, _ in graphs.keys), graphs.keys
    assert len(pointers) == 1 and graphs.buffers.allocations == allocations, "a fixed-shape step moved its buffers"


def _items(pool: PagePool, lengths: list[int], q: int, rng: random.Random) -> list[StepItem]:
    items = []
    for n in lengths:
        table = BlockTable(pool)
        table.reserve(n)
        table.advance(n)
        items.append(StepItem(table, [rng.randrange(320) for _ in range(q)], q))
    return items


def test_keys_bucket_the_batch_and_context_and_refuse_what_varies(ckpt):
    engine = _engine(ckpt, True)
    graphs, pool = engine.runner.graphs, engine.pool
    rng = random.Random(0)
    short = min(MIN_SEQ_BUCKET, graphs.capacity)
    assert graphs.key(_items(pool, [5, 9, 30], 1, rng)) == (4, 1, short)
    assert graphs.key(_items(pool, [5], 3, rng)) == (1, 3, short)
    mixed = _items(pool, [5], 1, rng) + _items(pool, [6], 2, rng)
    assert graphs.key(mixed) is None, "query lengths differ"
    last_only = _items(pool, [5], 3, rng)
    last_only[0].num_logits = 1
    assert graphs.key(last_only) is None, "a prefill chunk wants one logit"
    assert graphs.key(_items(pool, [5], MAX_QUERY + 1, rng)) is None
    assert graphs.key(_items(pool, [1] * (graphs.max_batch + 1), 1, rng)) is None


def test_context_buckets_stop_at_the_capacity(ckpt):
    model = _engine(ckpt, False).model
    cfg = model.cfg
    pool = PagePool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages=5000, page_size=PS)
    graphs = DecodeGraphs(model, pool, max_context=10_000)  # 2,500 pages a sequence: 10,000 tokens
    assert graphs.capacity == 10_000
    rng = random.Random(1)
    for length, want in ((100, MIN_SEQ_BUCKET), (5000, 8192), (8191, 8192), (8192, 10_000), (9999, 10_000)):
        assert graphs.key(_items(pool, [3, length], 1, rng)) == (2, 1, want), length
    assert graphs.key(_items(pool, [10_000], 1, rng)) is None, "past the capacity: eager"
    # The pool bounds a sequence too.
    assert DecodeGraphs(model, PagePool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 40, PS), 10_000).capacity == 160


def test_capture_needs_cuda(ckpt):
    engine = _engine(ckpt, False)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(engine.model, engine.pool, 1024, capture=True)
    assert _engine(ckpt, None).runner.graphs is None, "graphs are on by default only on CUDA"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_graphs_replay_what_eager_steps_compute(ckpt):
    def engine(graphs: bool) -> Engine:
        return Engine.from_pretrained(ckpt, device="cuda", page_size=PS, num_pages=512, prefix_cache=False,
                                      drafter="ngram", limits=Limits(prefill_chunk=16, max_num_batched_tokens=64),
                                      decode_graphs=graphs)

    eager, captured = engine(False), engine(True)
    want, got = _round(eager), _round(captured)
    graphs = captured.runner.graphs
    assert graphs.capture and graphs.captures == len(graphs.keys) and graphs.replays > graphs.captures
    for i in want:
        # cuBLAS may block a padded batch's rows differently: close, not equal.
        torch.testing.assert_close(got[i][1], want[i][1], atol=2e-3, rtol=0)
        assert got[i][0][: len(_prompt(i)) + 4] == want[i][0][: len(_prompt(i)) + 4], f"session {i}"
