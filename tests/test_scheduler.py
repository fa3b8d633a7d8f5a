"""Continuous batching: requests from many threads share forwards and get the
same greedy tokens as when run one at a time."""
import threading

import pytest
import torch

from agentkv import Engine, KVCapacityError
from tests.conftest import assert_all_pages_free
from tests.hf_models import make_hf_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("sched")
    make_hf_model("llama-gqa-llama3rope-tied", path, seed=4)
    return path


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 320, (int(torch.randint(3, 60, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def conversation(engine: Engine, prompt: list[int], turns: int, results: list, i: int, barrier=None) -> None:
    if barrier is not None:
        barrier.wait()
    with engine.session() as s:
        out = []
        for t in range(turns):
            s.queue(prompt[t::turns] or [1])
            out.append(s.generate(max_tokens=6 + 3 * t, ignore_eos=True, speculative=t % 2 == 0))
        results[i] = out


def test_concurrent_sessions_match_sequential(ckpt):
    ps = prompts(8)
    engine = Engine.from_pretrained(ckpt, page_size=8, num_pages=256)
    sequential = [None] * len(ps)
    for i, p in enumerate(ps):
        conversation(engine, p, 3, sequential, i)
    engine.scheduler.start()
    try:
        concurrent = [None] * len(ps)
        barrier = threading.Barrier(len(ps))
        threads = [threading.Thread(target=conversation, args=(engine, p, 3, concurrent, i, barrier)) for i, p in enumerate(ps)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        engine.scheduler.stop()
    assert concurrent == sequential
    assert_all_pages_free(engine)


def test_capacity_error_fails_only_the_request_that_does_not_fit(ckpt):
    engine = Engine.from_pretrained(ckpt, page_size=8, num_pages=12)
    small, big = engine.session(), engine.session()
    small.append(list(range(10)))
    big.queue(list(range(100)))  # 13 pages: more than the pool holds
    with pytest.raises(KVCapacityError):
        big.generate(max_tokens=4, ignore_eos=True)
    assert len(big) == 100 and big.table.length == 0
    assert len(small.generate(max_tokens=4, ignore_eos=True)) == 4
    small.close()
    big.close()


def test_a_failing_stream_consumer_ends_only_its_own_request(ckpt):
    engine = Engine.from_pretrained(ckpt, page_size=8, num_pages=64)
    good, bad = engine.session(), engine.session()
    good.append(list(range(12)))
    bad.append(list(range(20, 30)))
    before = (bad.tokens, bad.table.length)

    def explode(tokens):
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError, match="client went away"):
        bad.generate(max_tokens=5, ignore_eos=True, on_tokens=explode)
    assert (bad.tokens, bad.table.length) == before
    assert len(good.generate(max_tokens=5, ignore_eos=True)) == 5
    assert good.finish_reason == "length"
    good.close()
    bad.close()


def test_stopping_the_loop_fails_waiting_requests_instead_of_hanging(ckpt):
    engine = Engine.from_pretrained(ckpt, page_size=8, num_pages=64)
    s = engine.session()
    s.append(list(range(12)))
    req = s.start_generate(max_tokens=3, ignore_eos=True)  # no loop running: nobody steps it
    engine.scheduler.stop()
    assert req.done.is_set() and req.error is not None
    assert s.tokens == list(range(12))
    s.close()
