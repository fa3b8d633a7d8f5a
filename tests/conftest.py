import os

import torch

# The Triton interpreter must be chosen before triton is first imported.
# Tests run tiny shapes: one thread avoids OpenMP hand-offs that cost more
# than the ops themselves (and stall badly when the cores are shared).
torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gc  # noqa: E402

import pytest  # noqa: E402

from cache.pool import PagePool  # noqa: E402


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def page_accounting():
    """The invariant of the design: after every test, every pool still alive
    has free + referenced == total and refcounts that match their holders."""
    yield
    gc.collect()
    for pool in list(PagePool.live):
        pool.check()


def assert_all_pages_free(engine) -> None:
    """Once the prefix cache lets go, no page may still be referenced."""
    if engine.radix is not None:
        engine.radix.clear()
    assert engine.pool.num_free == engine.pool.num_pages
