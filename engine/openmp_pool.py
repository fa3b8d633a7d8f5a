"""Giving back a thread's OpenMP workers, so that the scheduler thread's run at full speed.

GNU OpenMP (libgomp, what torch's Linux wheels run their intra-op threads
on) keeps one pool of worker threads for each thread that ever ran a
parallel op, for as long as that thread lives. While the pools together
hold more threads than the process may use cores, every worker sleeps on a
futex almost at once after each parallel region instead of spinning for the
next one, and a decode step runs hundreds of them: so once the scheduler
thread steps, the idle pool of the thread that loaded the model and stepped
inline (the main thread) slowed each decode step of a single stream well
below the same step driven inline (docs/bench_served_stream.md). A pool can
only be given back by its own thread.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Callable

import torch  # noqa: F401  (loads the OpenMP runtime looked for here)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the threads go, the runtime stays usable


@functools.cache
def _pause() -> Callable[[int], int] | None:
    """libgomp's omp_pause_resource_all, as torch loaded it; None under
    another OpenMP runtime (LLVM's or Intel's: there a pause stops every
    thread's pool, and their idle workers spin for a fixed time whatever
    the thread count) or none."""
    process = ctypes.CDLL(None)
    if not hasattr(process, "GOMP_parallel") or hasattr(process, "kmp_set_blocktime"):
        return None
    pause = getattr(process, "omp_pause_resource_all", None)  # OpenMP 5.0: GCC 9 on
    if pause is not None:
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


def release_openmp_pool() -> bool:
    """End the calling thread's OpenMP worker threads (made again by its next
    parallel op). Whether they were (False: no libgomp, or called inside a
    parallel region)."""
    pause = _pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
