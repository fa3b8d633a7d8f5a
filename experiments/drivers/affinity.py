"""Pinning a started system to given vCPUs: every thread of its process,
including the ones it started after its own launch (OpenMP and ggml pools,
vLLM's engine threads), since a thread inherits its creator's mask only
when it is created. Linux only (sched_setaffinity on thread ids from /proc)."""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def parse_cpus(text: str) -> list[int]:
    """'0' or '0,1' or '0-3' -> the vCPU ids, sorted, each one this process may run on.
    Raises ValueError on a malformed list or a vCPU outside this process's mask."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not (hi.isdigit() and int(hi) >= int(lo))):
            raise ValueError(f"bad vCPU list {text!r}: use ids like 0 or 0,1 or 0-1")
        cpus.update(range(int(lo), int(hi if sep else lo) + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise ValueError(f"vCPUs {sorted(cpus)} are not all in this process's {sorted(allowed)}")
    return sorted(cpus)


def pin_process(pid: int, cpus: Iterable[int]) -> int:
    """Every current thread of pid onto cpus; returns how many threads were
    pinned (0 for a process that is gone). A thread that exits meanwhile is skipped."""
    pinned = 0
    for task in _tasks(pid):
        try:
            os.sched_setaffinity(int(task.name), cpus)
            pinned += 1
        except (ProcessLookupError, FileNotFoundError):
            pass
    return pinned


def _tasks(pid: int) -> list[Path]:
    try:
        return list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []
