"""experiments.common.wait_for_quiet: bench_turns waits, untimed, before
each turn until the machine is quiet, so that one system's leftover work
(vLLM's engine core spins about a core for a second after a request) does not
fall on the next system's turn."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from agentkv.experiments import common

SPIN = "import time\nend = time.perf_counter() + {s}\nwhile time.perf_counter() < end: pass\n"


@pytest.mark.slow
def test_it_waits_while_another_process_keeps_a_core_busy():
    spinner = subprocess.Popen([sys.executable, "-c", SPIN.format(s=1.5)])
    try:
        time.sleep(0.2)  # the spinner is running
        waited = common.wait_for_quiet(max_s=8.0, window_s=0.1, below=0.5)
    finally:
        spinner.wait()
    assert waited >= 1.0  # it waited out most of the spinner's remaining 1.3 s


def test_it_gives_up_at_its_limit():
    spinner = subprocess.Popen([sys.executable, "-c", SPIN.format(s=3.0)])
    try:
        time.sleep(0.2)
        start = time.perf_counter()
        waited = common.wait_for_quiet(max_s=0.5, window_s=0.1, below=0.5)
        assert 0.5 <= waited < 1.5 and time.perf_counter() - start < 1.5
    finally:
        spinner.kill()
        spinner.wait()


def test_without_proc_stat_or_a_limit_it_does_not_wait(monkeypatch):
    assert common.wait_for_quiet(max_s=0.0) < 0.05
    monkeypatch.setattr(common, "_cpu_times", lambda: None)
    assert common.wait_for_quiet(max_s=5.0) < 0.05
