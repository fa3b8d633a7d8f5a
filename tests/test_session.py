"""Sessions: reuse, rollback, fork, and bad input that changes nothing."""
import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentkv import (
    ContextLengthError,
    Engine,
    InvalidRequestError,
    KVCapacityError,
    ModelLoadError,
    SessionBusyError,
    SessionClosedError,
    UnsupportedModelError,
)
from tests.conftest import assert_all_pages_free
from tests.hf_models import make_hf_model

VOCAB = 320


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf_model("llama-gqa-llama3rope-tied", path)
    return path


@pytest.fixture
def engine(ckpt):
    return Engine.from_pretrained(ckpt, page_size=8, num_pages=64)


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(engine: Engine, ids: list[int]) -> torch.Tensor:
    with engine.session() as s:
        return s.append(ids, all_logits=True)


def snapshot(engine: Engine, *sessions):
    return (
        [(s.tokens, list(s.table.pages), s.table.length) for s in sessions],
        engine.pool.num_free,
        list(engine.pool.refcount),
    )


@pytest.mark.parametrize("cut", [0, 5, 8, 13])  # empty, mid-page, page boundary, mid-page
def test_truncate_then_reappend_equals_never_appended(engine, cut):
    a, b, c = rand_ids(13, 1), rand_ids(11, 2), rand_ids(6, 3)
    with engine.session() as s:
        s.append(a)
        s.append(b)
        s.truncate(cut)
        assert s.tokens == a[:cut] and len(s) == cut
        assert len(s.table.pages) == -(-cut // 8)
        got = s.append(c, all_logits=True)
    torch.testing.assert_close(got, prefill(engine, a[:cut] + c)[cut:], atol=1e-5, rtol=0)


def test_fork_then_diverge_leaves_parent_untouched(engine):
    a, x, y = rand_ids(21, 4), rand_ids(9, 5), rand_ids(4, 6)
    parent = engine.session()
    parent.append(a)
    child = parent.fork()
    assert child.tokens == parent.tokens and child.table.pages == parent.table.pages
    assert all(engine.pool.refcount[p] == 2 for p in parent.table.pages)
    child_logits = child.append(x, all_logits=True)
    # The partially filled last page was copied before the child wrote to it;
    # full pages stay shared.
    assert child.table.pages[:2] == parent.table.pages[:2]
    assert child.table.pages[2] != parent.table.pages[2]
    assert parent.tokens == a
    parent_logits = parent.append(y, all_logits=True)
    torch.testing.assert_close(parent_logits, prefill(engine, a + y)[21:], atol=1e-5, rtol=0)
    torch.testing.assert_close(child_logits, prefill(engine, a + x)[21:], atol=1e-5, rtol=0)
    parent.close()
    assert child.tokens == a + x
    child.close()
    assert_all_pages_free(engine)


def test_generated_tokens_stay_in_the_session(engine):
    prompt, more = rand_ids(10, 7), rand_ids(5, 8)
    with engine.session() as s:
        s.append(prompt)
        out = s.generate(max_tokens=12, ignore_eos=True)
        assert len(out) == 12 and s.tokens == prompt + out
        got = s.append(more, all_logits=True)
        ref = prefill(engine, prompt + out + more)
        torch.testing.assert_close(got, ref[-5:], atol=1e-5, rtol=0)
        # The drawn-but-uncomputed last token rode along with the append.
        assert engine.stats[-1].generated_tokens == 12


def test_generate_after_truncate_and_fork_recomputes_last_logits(engine):
    prompt = rand_ids(17, 9)
    with engine.session() as s:
        s.append(prompt)
        first = s.generate(max_tokens=6, ignore_eos=True)
        s.truncate(17)
        again = s.generate(max_tokens=6, ignore_eos=True)
        assert again == first
        s.truncate(17)
        with s.fork() as f:
            assert f.generate(max_tokens=6, ignore_eos=True) == first


def test_stop_token_and_max_tokens(engine):
    prompt = rand_ids(9, 10)
    with engine.session() as s:
        s.append(prompt)
        free_run = s.generate(max_tokens=10, ignore_eos=True)
        s.truncate(9)
        stopped = s.generate(max_tokens=10, stop_token_ids=[free_run[3]])
        assert stopped == free_run[: free_run.index(free_run[3]) + 1]
        assert s.tokens == prompt + stopped


@pytest.mark.parametrize(
    "bad, error",
    [([VOCAB], InvalidRequestError), ([-1], InvalidRequestError), ([], InvalidRequestError),
     ([1.5], InvalidRequestError), (list(range(100)) * 6, ContextLengthError)],
)
def test_bad_append_changes_nothing(engine, bad, error):
    s = engine.session()
    s.append(rand_ids(11, 11))
    before = snapshot(engine, s)
    with pytest.raises(error):
        s.append(bad)
    assert snapshot(engine, s) == before
    s.close()


def test_truncate_past_end_changes_nothing(engine):
    s = engine.session()
    s.append(rand_ids(11, 12))
    before = snapshot(engine, s)
    for n in (12, -1, 3.0):
        with pytest.raises(InvalidRequestError):
            s.truncate(n)
    assert snapshot(engine, s) == before
    s.close()


def test_beyond_pool_capacity_is_typed_and_changes_nothing(engine):
    big = engine.session(pin_ttl=None)  # pinned for good: never gives way
    big.append(rand_ids(300, 13))  # 38 of 64 pages
    other = engine.session()
    other.append(rand_ids(20, 14))
    before = snapshot(engine, big, other)
    with pytest.raises(KVCapacityError):
        other.append(rand_ids(200, 15))
    assert snapshot(engine, big, other) == before
    # Running out in the middle of a generation rolls the whole call back.
    other.append(rand_ids(170, 16))  # 1 page left, 6 free slots in other's last page
    before = snapshot(engine, big, other)
    with pytest.raises(KVCapacityError):
        other.generate(max_tokens=40, ignore_eos=True)
    assert snapshot(engine, big, other) == before
    big.close()
    other.close()


def test_busy_and_closed_sessions(engine):
    s = engine.session()
    s.append(rand_ids(5, 17))
    entered, release = threading.Event(), threading.Event()
    original = engine.runner.step

    def slow_step(items):
        entered.set()
        release.wait(10)
        return original(items)

    engine.runner.step = slow_step
    worker = threading.Thread(target=lambda: s.generate(max_tokens=2, ignore_eos=True))
    worker.start()
    entered.wait(10)
    with pytest.raises(SessionBusyError):
        s.append([1])
    release.set()
    worker.join()
    engine.runner.step = original
    s.close()
    assert_all_pages_free(engine)
    with pytest.raises(SessionClosedError):
        s.append([1])


def test_dropped_session_returns_its_pages(engine):
    s = engine.session()
    s.append(rand_ids(40, 18))
    del s
    import gc

    gc.collect()
    assert_all_pages_free(engine)


def test_a_session_dropped_while_a_step_holds_the_lock_is_closed_by_the_next_step(engine):
    """Its collector (on a server, maybe the event loop) never waits for the
    engine's lock: the scheduler's next step closes it."""
    s = engine.session()
    s.append(rand_ids(40, 18))
    held, release = threading.Event(), threading.Event()

    def step_in_progress():
        with engine.lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=step_in_progress)
    t.start()
    held.wait(10)
    import gc

    del s
    started = time.monotonic()
    gc.collect()
    assert time.monotonic() - started < 1.0  # did not wait for the lock
    assert engine.pool.num_free < engine.pool.num_pages  # still held: closed later
    release.set()
    t.join()
    engine.scheduler.step()
    assert_all_pages_free(engine)


def test_sharded_checkpoint_and_half_precision(tmp_path):
    hf = make_hf_model("qwen2-qkvbias", tmp_path / "full")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids = rand_ids(30, 19)
    ref = prefill(Engine.from_pretrained(tmp_path / "full", page_size=8, num_pages=16), ids)
    got = prefill(Engine.from_pretrained(tmp_path / "sharded", page_size=8, num_pages=16), ids)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    for dtype in ("bfloat16", "float16"):
        half = prefill(Engine.from_pretrained(tmp_path / "full", dtype=dtype, page_size=8, num_pages=16), ids)
        torch.testing.assert_close(half, ref, atol=0.15, rtol=0.05)


def test_bad_checkpoints_are_typed_errors(tmp_path, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    weights = load_file(ckpt / "model.safetensors")

    def write(name: str, config: dict, tensors: dict):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        save_file(tensors, d / "model.safetensors")
        return d

    with pytest.raises(UnsupportedModelError, match="gpt2"):
        Engine.from_pretrained(write("arch", {**cfg, "model_type": "gpt2"}, weights))
    missing = dict(weights)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        Engine.from_pretrained(write("missing", cfg, missing))
    wrong = dict(weights)
    wrong["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 63)
    with pytest.raises(ModelLoadError, match="shape"):
        Engine.from_pretrained(write("shape", cfg, wrong))
    with pytest.raises(ModelLoadError, match="dtype"):
        Engine.from_pretrained(ckpt, dtype="float64")
    with pytest.raises(ModelLoadError, match="config.json"):
        Engine.from_pretrained(tmp_path / "nothing-here")
    no_weights = write("noweights", cfg, {})
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        Engine.from_pretrained(no_weights)
