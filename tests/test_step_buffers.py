"""A step's inputs live in persistent buffers (kernels.metadata.StepBuffers,
the runner's ids and logit rows): after warm-up a long mixed run of steps
(prefill chunks, decodes, verifies, sequences joining and leaving) makes no
new metadata tensor, and what the buffers hold is what a fresh build of each
step would hold, so outputs are those of sequences run alone."""
from __future__ import annotations

import random

import pytest
import torch

from agentkv import Engine
from agentkv.engine.limits import Limits
from agentkv.kernels.metadata import AttnMetadata, StepBuffers, bucket
from tests.hf_models import make_hf_model

PS = 4
FIELDS = ("cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping", "positions")


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 1000)] == [1, 1, 2, 4, 4, 8, 8, 16, 1024]


def _random_step(rng: random.Random, tables: dict[int, list[int]]) -> tuple[list[int], list[int], list[list[int]]]:
    """A ragged step over some of the live tables, in a shuffled order; each
    table grows, shrinks, or has a page swapped (copy-on-write) now and then."""
    names = rng.sample(sorted(tables), rng.randint(1, len(tables)))
    query_lens, seq_lens, rows = [], [], []
    for name in names:
        pages = tables[name]
        what = rng.random()
        if what < 0.1 and len(pages) > 1:
            del pages[rng.randint(1, len(pages) - 1):]
        elif what < 0.2:
            pages[rng.randrange(len(pages))] = rng.randrange(1000)
        elif what < 0.6:
            pages.extend(rng.randrange(1000) for _ in range(rng.randint(1, 3)))
        q_len = min(rng.choice([1, 1, 1, rng.randint(2, 9), rng.randint(10, 40)]), len(pages) * PS)
        s_len = rng.randint(max(q_len, (len(pages) - 1) * PS + 1), len(pages) * PS)
        query_lens.append(q_len)
        seq_lens.append(s_len)
        rows.append(list(pages))
    return query_lens, seq_lens, rows


@pytest.mark.parametrize("seed", range(5))
def test_buffers_build_what_a_fresh_build_does_and_stop_allocating(seed):
    rng = random.Random(seed)
    tables = {i: [rng.randrange(1000) for _ in range(rng.randint(1, 30))] for i in range(8)}
    buffers = StepBuffers(PS)
    # Warm-up at the largest shapes the run can reach: 8 sequences of the
    # longest chunk, tables of up to 64 pages.
    buffers.build([40] * 8, [64 * PS] * 8, [list(range(64))] * 8)
    warm = buffers.allocations
    pointers = None
    for _ in range(300):
        for pages in tables.values():
            del pages[60:]  # stay within the warm-up's widths
        step = _random_step(rng, tables)
        got = buffers.build(*step)
        want = AttnMetadata.build(*step, PS)
        for name in FIELDS:
            assert torch.equal(getattr(got, name), getattr(want, name)), name
            assert getattr(got, name).dtype == getattr(want, name).dtype, name
        assert (got.max_query_len, got.max_seq_len) == (max(step[0]), max(step[1]))
        ptrs = {name: getattr(got, name).data_ptr() for name in FIELDS}
        assert pointers is None or ptrs == pointers, "a step made a new metadata tensor"
        pointers = ptrs
    assert buffers.allocations == warm


def test_buffers_grow_by_powers_of_two_and_bad_input_changes_nothing():
    buffers = StepBuffers(PS)
    meta = buffers.build([3], [5], [[7, 8]])
    assert meta.slot_mapping.tolist() == [30, 31, 32]
    before = buffers.allocations
    for step in (([1], [9], [[0, 1]]), ([0], [3], [[0]]), ([], [], [])):
        with pytest.raises(ValueError):
            buffers.build(*step)
    assert buffers.allocations == before
    buffers.build([5], [6], [[1, 2]])  # 5 tokens: the token buffers grow from 4 to 8
    assert buffers.allocations == before + 2
    assert torch.equal(buffers.build([3], [5], [[7, 8]]).slot_mapping, meta.slot_mapping)


def test_repeated_steps_reuse_offsets_and_views_until_a_buffer_is_remade():
    buffers = StepBuffers(PS)
    tables = [[3, 4], [5, 6, 7]]
    first = buffers.build([1, 1], [5, 9], tables)
    # The next decode step of the same sequences: the same views, new contents.
    second = buffers.build([1, 1], [6, 10], [[3, 4], [5, 6, 7]])
    assert all(getattr(second, name) is getattr(first, name) for name in FIELDS)
    for step in (([1, 1], [6, 10], tables), ([2, 1], [8, 10], tables), ([1, 1], [7, 11], tables)):
        got, want = buffers.build(*step), AttnMetadata.build(*step, PS)
        assert all(torch.equal(getattr(got, name), getattr(want, name)) for name in FIELDS)
    # Growing a buffer remakes it (zeros): the offsets of the same query
    # lengths are written again, not taken for still there.
    buffers.reserve(seqs=64, pages=16, tokens=64)
    step = ([1, 1], [8, 12], tables)
    got, want = buffers.build(*step), AttnMetadata.build(*step, PS)
    assert got.cu_seqlens_q.tolist() == [0, 1, 2]
    assert all(torch.equal(getattr(got, name), getattr(want, name)) for name in FIELDS)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("step-buffers")
    make_hf_model("llama-gqa-llama3rope-tied", path, seed=5)
    return path


def _engine(ckpt) -> Engine:
    # Prompt lookup, not the suffix drafter: the namespace's output tree would
    # let the measured round draft longer than its warm-up twin (it has seen
    # the warm-up's outputs), so its steps could outgrow what warm-up sized.
    return Engine.from_pretrained(ckpt, page_size=PS, num_pages=512, prefix_cache=False, drafter="ngram",
                                  limits=Limits(prefill_chunk=16, max_num_batched_tokens=64))


def _prompt(seed: int) -> list[int]:
    # Repeating phrases, so that prompt lookup drafts and steps verify.
    rng = random.Random(seed)
    phrases = [[rng.randrange(320) for _ in range(5)] for _ in range(3)]
    return [t for _ in range(rng.randint(3, 7)) for t in rng.choice(phrases)] + [rng.randrange(320)]


def _round(engine: Engine, seed: int) -> dict[int, tuple[list[int], torch.Tensor]]:
    """Five sessions that join at different times, prefill in chunks, decode
    and verify side by side; two leave early. Returns each session's tokens
    and the logits of its last token."""
    out = {}
    sessions = {i: engine.session() for i in range(5)}
    reqs = {}
    for i in (0, 1, 2):
        sessions[i].queue(_prompt(seed + i))
        reqs[i] = sessions[i].start_generate(max_tokens=12 + 3 * i, ignore_eos=True, speculative=i != 1)
    engine.scheduler.step()
    engine.scheduler.step()
    for i in (3, 4):  # join mid-run
        sessions[i].queue(_prompt(seed + i))
        reqs[i] = sessions[i].start_generate(max_tokens=10, ignore_eos=True)
    for i in (0, 3):  # leave once done
        engine.scheduler.wait(reqs[i])
        out[i] = (list(sessions[i].tokens), sessions[i].append([7]))
        sessions.pop(i).close()
    for i, s in sessions.items():
        engine.scheduler.wait(reqs[i])
        out[i] = (list(s.tokens), s.append([7]))
        s.close()
    return out


def test_a_long_mixed_run_makes_no_new_metadata_tensors_and_matches_sequences_alone(ckpt):
    engine = _engine(ckpt)
    runner = engine.runner
    shapes, pointers = [], set()
    build, step = runner.buffers.build, runner.step

    def recording_build(*args, **kwargs):
        meta = build(*args, **kwargs)
        pointers.add(tuple(getattr(meta, name).data_ptr() for name in FIELDS))
        return meta

    def recording_step(items):
        shapes.append([(len(it.tokens), it.num_logits) for it in items])
        return step(items)

    runner.buffers.build = recording_build
    runner.step = recording_step
    _round(engine, seed=100)  # warm-up: the buffers grow to the run's largest step
    warm, shapes[:] = runner.allocations, []
    pointers.clear()
    got = _round(engine, seed=100)
    assert runner.allocations == warm
    assert len(pointers) == 1, "a step's metadata came from new tensors"

    flat = [s for step_shape in shapes for s in step_shape]
    assert any(n > 1 and k == 1 for n, k in flat), "no prefill chunk ran"
    assert any(n == 1 for n, _ in flat), "no decode ran"
    assert any(k > 1 for _, k in flat), "no verify ran"
    assert any(len(s) >= 3 for s in shapes), "sequences never shared a step"

    for i, (tokens, last) in got.items():
        alone = _engine(ckpt)
        with alone.session() as s:
            s.queue(_prompt(100 + i))
            s.generate(max_tokens=len(tokens) - len(_prompt(100 + i)), ignore_eos=True, speculative=False)
            assert s.tokens == tokens, f"session {i}: greedy output differs from the sequence alone"
            want = s.append([7])
        fresh = _engine(ckpt)
        with fresh.session() as s:
            prefill = s.append(tokens + [7])
        torch.testing.assert_close(last, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(last, prefill, atol=1e-4, rtol=0)
