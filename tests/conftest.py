import os

import torch

# The Triton interpreter must be chosen before triton is first imported.
# Tests run tiny shapes: one thread avoids OpenMP hand-offs that cost more
# than the ops themselves (and stall badly when the cores are shared).
torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gc  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Iterator  # noqa: E402

import pytest  # noqa: E402

from agentkv.cache.pool import PagePool  # noqa: E402
from agentkv.kernels import dispatch  # noqa: E402
from agentkv.kernels.cpu_extension import host_isas, isa  # noqa: E402


def pytest_collection_finish(session: pytest.Session) -> None:
    """Moves what importing the tests made (torch, transformers, ... some 700k
    objects) out of the collector's sight: page_accounting's gc.collect()
    after every test then walks only what tests made since, not 0.4 s of
    modules that live until exit. What the tests make is collected as before."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    # Frozen objects are never freed otherwise, and extensions that count
    # their instances (triton's nanobind) report them as leaks at exit.
    gc.unfreeze()


@pytest.fixture(params=host_isas())
def cpu_isa(request, monkeypatch) -> Iterator[str]:
    """Each vector ISA this CPU runs, in turn, for the C++ kernels: on an
    AVX-512 host the AVX2 builds run too, so CI covers both paths anywhere.
    The kernels under test are dispatched to on every ISA, also where the
    engine prefers the torch path (dispatch.CPP_ATTENTION_WINS)."""
    with monkeypatch.context() as patched:
        patched.setenv("AGENTKV_CPU_ISA", request.param)
        patched.setitem(dispatch.CPP_ATTENTION_WINS, request.param, True)
        isa()  # direct kernel calls run the ISA it read last
        yield request.param
    isa()


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def page_accounting():
    """The invariant of the design: after every test, every pool still alive
    has free + referenced == total and refcounts that match their holders.
    A pool dead in a reference cycle stays listed until collected, so a test
    that leaves none listed made none to check and skips the full collection."""
    yield
    if not PagePool.live:
        return
    gc.collect()
    for pool in list(PagePool.live):
        pool.check()


def assert_all_pages_free(engine) -> None:
    """Once the prefix cache lets go, no page may still be referenced."""
    if engine.radix is not None:
        engine.radix.clear()
    assert engine.pool.num_free == engine.pool.num_pages


@contextmanager
def http_server(app) -> Iterator[str]:
    """app served over real HTTP by uvicorn, in a thread, on a free port of
    127.0.0.1; yields its base URL, and stops it (its lifespan included) after."""
    import uvicorn

    sock = socket.socket()
    # Accepted connections inherit it; uvicorn sets it only on sockets it
    # makes itself, and without it every response waits ~40 ms for an ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(600):
        if uv.started:
            break
        time.sleep(0.05)
    assert uv.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(60)
        sock.close()
    assert not thread.is_alive()
