"""Smoke test of experiments.benchmarks.bench_host_work at two short lengths: it writes
its JSON and report, and both modes plan the same new tokens (timings are
the benchmark's to report, not this test's to assert)."""
from __future__ import annotations

import json

import pytest

from agentkv.experiments.benchmarks import bench_host_work

pytestmark = pytest.mark.slow


def test_writes_results_and_both_modes_queue_the_same(tmp_path):
    bench_host_work.main(["--lengths", "500,4000", "--repeats", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["history_tokens"] >= want for r, want in zip(rows, (500, 4000))] == [True, True]
    assert all(r["native_queued"] == r["template-faithful_queued"] > 0 for r in rows)
    assert (tmp_path / "report.txt").read_text().strip()
