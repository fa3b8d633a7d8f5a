"""A thread's OpenMP workers given back (engine.openmp_pool), and the
scheduler giving back its starter's before its loop steps: left idle beside
the loop's, they make libgomp's workers sleep between the ops of every step."""
from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterator

import pytest
import torch

from agentkv import Engine
from agentkv.engine.openmp_pool import release_openmp_pool
from agentkv.model.default import small_model_dir


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settled_threads(expected: int, within_s: float = 5.0) -> int:
    """The thread count once it reaches `expected`, or as it stands after `within_s`:
    libgomp's workers leave the pool's barrier before they exit, so a released
    worker can still be listed for a moment after the pause returns."""
    deadline = time.monotonic() + within_s
    while (n := os_threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


def parallel_op() -> None:
    """An elementwise op well over ATen's grain: it runs on the thread's OpenMP pool."""
    torch.ones(1 << 22).add_(1)


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    if not release_openmp_pool():
        pytest.skip("torch runs on another OpenMP runtime than libgomp: no pool to give back")
    old = torch.get_num_threads()
    torch.set_num_threads(2)  # one worker per pool, on any host
    yield
    torch.set_num_threads(old)


def in_thread(fn: Callable[[], list[int]]) -> list[int]:
    box: list = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    thread.join()
    return box[0]


def test_release_ends_the_calling_threads_workers_only():
    def counts() -> list[int]:
        parallel_op()
        held = os_threads()
        assert release_openmp_pool()
        released = settled_threads(held - 1)
        parallel_op()  # a pool again
        return [held, released, os_threads()]

    parallel_op()  # the main thread's pool, which stays
    held, released, again = in_thread(counts)
    assert released == held - 1 and again == held


@pytest.mark.slow
def test_serving_gives_back_the_starting_threads_workers():
    engine = Engine.from_pretrained(small_model_dir())
    with engine.session() as s:
        s.append([5, 6, 7])  # stepped inline, here
    parallel_op()
    before = os_threads()
    engine.start_serving()
    try:
        # The loop's thread is one more; this thread's worker is gone (the loop has no pool before its first op).
        assert settled_threads(before) == before
        with engine.session() as s:
            s.append([5, 6, 7])
            assert len(s.generate(max_tokens=3, ignore_eos=True)) == 3
    finally:
        engine.stop_serving()
