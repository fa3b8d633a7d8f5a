"""experiments.benchmarks.proc_usage: the arithmetic of a usage over two snapshots, and
that the /proc readers see this process's own CPU time."""
from __future__ import annotations

import os
import sys
import time

import pytest

from agentkv.experiments.benchmarks.proc_usage import (TICK, ProcTicks, Snapshot, machine_ticks, proc_ticks, snapshot,
                                                       usage, vcpu_ticks, wait_quiet)


def test_usage_splits_the_machine_into_timed_others_and_foreign():
    before = Snapshot(ProcTicks(100, 5, 1, 10), {7: ProcTicks(50, 0, 0, 0), 8: None}, (1000, 20))
    after = Snapshot(ProcTicks(100 + 2 * TICK, 9, 1, 13), {7: ProcTicks(50 + TICK // 2, 0, 0, 0), 8: None},
                     (1000 + 3 * TICK, 20 + TICK // 4))
    u = usage(before, after, 2.0)
    assert u["cpu_per_wall"] == pytest.approx(1.0) and u["minflt"] == 4 and u["majflt"] == 0
    assert u["nonvoluntary"] == 3
    assert u["others_cores"] == pytest.approx(0.25)
    # 3 s busy in all, 2 of them the timed process's, 0.5 the other process's.
    assert u["foreign_cores"] == pytest.approx(0.25) and u["steal_share"] == pytest.approx(0.125)


def test_usage_says_which_vcpu_was_busy():
    before = Snapshot(None, {}, None, {0: 10, 1: 500})
    after = Snapshot(None, {}, None, {0: 10 + TICK, 1: 500 + TICK // 10})
    assert usage(before, after, 1.0)["vcpu_busy"] == pytest.approx({0: 1.0, 1: 0.1})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_vcpu_ticks_has_every_vcpu_and_sums_to_the_machine():
    ticks, machine = vcpu_ticks(), machine_ticks()
    assert set(ticks) >= os.sched_getaffinity(0)
    # Read a moment apart: the per-vCPU sum may be a few ticks ahead of the total.
    assert abs(sum(ticks.values()) - machine[0]) <= 10 * len(ticks)


def test_usage_without_proc_or_wall_is_unknown():
    empty = Snapshot(None, {}, None)
    assert set(usage(empty, empty, 0.0).values()) == {None}
    u = usage(empty, empty, 1.0)
    assert u["cpu_per_wall"] is None and u["foreign_cores"] is None and u["others_cores"] == 0


def test_a_gone_process_reads_as_none():
    assert proc_ticks(2**22 + 12345) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_readers_see_this_process_burn_cpu():
    before = snapshot(os.getpid(), [])
    assert before.timed is not None and machine_ticks() is not None
    start, wall = time.process_time(), time.perf_counter()
    while time.process_time() - start < 0.3:
        pass
    after = snapshot(os.getpid(), [])
    u = usage(before, after, time.perf_counter() - wall)
    # Ticks are coarse (1 / TICK s): 0.3 s of CPU is at least 0.2 s of them.
    assert after.timed.cpu - before.timed.cpu >= 0.2 * TICK and u["cpu_per_wall"] > 0
    assert after.machine[0] - before.machine[0] >= after.timed.cpu - before.timed.cpu - 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_wait_quiet_waits_one_window_when_quiet_and_gives_up_at_the_timeout():
    assert 0.1 <= wait_quiet([os.getpid()], float("inf"), window_s=0.1, timeout_s=5.0) < 2.0
    # Nothing is ever below -1 cores: it waits windows until the timeout.
    assert 0.5 <= wait_quiet([os.getpid()], -1.0, window_s=0.1, timeout_s=0.5) < 3.0
