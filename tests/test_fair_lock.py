"""The engine's lock (engine.fair_lock) is granted in the order asked for:
a loop that releases and asks again at once, as the scheduler does after
every step, no longer starves a thread that asked during its step."""
import threading
import time

import pytest

from agentkv.engine.fair_lock import FairLock


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_reentrant_and_only_its_holder_releases():
    lock = FairLock()
    with lock:
        with lock:
            assert lock.held_by_me()
        assert lock.held_by_me()
        got = []
        t = threading.Thread(target=lambda: got.append(lock.acquire(blocking=False)))
        t.start()
        t.join()
        assert got == [False]  # held (once still) by this thread
    assert not lock.held_by_me()
    with pytest.raises(RuntimeError):
        lock.release()
    t = threading.Thread(target=lock.acquire)
    t.start()
    t.join()
    with pytest.raises(RuntimeError):  # held by the thread that ended, not by this one
        lock.release()


def test_granted_in_the_order_asked():
    lock = FairLock()
    order, threads = [], []
    with lock:
        for i in range(5):
            def take(i=i):
                with lock:
                    order.append(i)
            threads.append(threading.Thread(target=take))
            threads[-1].start()
            wait_for(lambda: lock.waiting == i + 1)  # each asks only once the one before waits
        tried = []
        probe = threading.Thread(target=lambda: tried.append(lock.acquire(blocking=False)))
        probe.start()
        probe.join()
        assert tried == [False]  # no jumping the queue
    for t in threads:
        t.join()
    assert order == [0, 1, 2, 3, 4]
    assert lock.waiting == 0 and lock.acquire(blocking=False)
    lock.release()


def test_a_waiter_is_not_passed_over_by_a_loop_that_asks_again_at_once():
    """The scheduler's pattern: hold for a step, release, ask again with no
    pause. A thread that asked during step k runs before step k + 1."""
    lock = FairLock()
    steps, stop, got_at = [0], threading.Event(), []

    def loop():
        while not stop.is_set():
            with lock:
                steps[0] += 1
                time.sleep(0.005)  # the step's forward

    t = threading.Thread(target=loop)
    t.start()
    try:
        for _ in range(20):
            wait_for(lambda: lock.waiting == 0)
            asked = steps[0]
            with lock:
                got_at.append(steps[0] - asked)
    finally:
        stop.set()
        t.join()
    # The step under way when it asked (and at most the next one, if the loop
    # had asked first) ran before it: never a run of steps.
    assert max(got_at) <= 2, got_at


def test_an_interrupted_waiter_leaves_the_queue():
    lock = FairLock()
    lock.acquire()
    errors = []

    def waiter():
        try:
            lock.acquire()
        except KeyboardInterrupt:
            errors.append("interrupted")

    # An exception raised into a waiting thread: its gate's acquire is what raises.
    import ctypes

    t = threading.Thread(target=waiter)
    t.start()
    wait_for(lambda: lock.waiting == 1)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(KeyboardInterrupt))
    lock.release()  # hands it over: the waiter wakes, sees the exception, and gives the lock back
    t.join(5)
    assert not t.is_alive() and errors == ["interrupted"]
    assert lock.waiting == 0 and lock.acquire(blocking=False)
    lock.release()
