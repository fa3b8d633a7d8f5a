"""Smoke test of experiments.benchmarks.bench_host_step at a short context: it writes
its JSON and report with a row per dtype and batch, each step having run
ops (timings are the benchmark's to report, not this test's to assert)."""
from __future__ import annotations

import json

import pytest

from agentkv.experiments.benchmarks import bench_host_step
from agentkv.kernels import cpu_layers

pytestmark = pytest.mark.slow


def test_writes_a_row_per_batch_with_counted_ops(tmp_path):
    bench_host_step.main(["--dtypes", "float32", "--context", "64", "--batches", "1,2", "--tokens", "4",
                          "--profile-tokens", "2", "--repeats", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["dtype"], r["batch"]) for r in rows] == [("float32", 1), ("float32", 2)]
    assert all(r["ops_per_step"] > 0 and r["op_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    if cpu_layers.available():  # fp32 steps run in the C++ layer loop: the time around it is measured
        assert all(r["outside_loop_ms"] is not None and 0 < r["outside_loop_ms"] < r["step_ms"] for r in rows)
    else:
        assert all(r["outside_loop_ms"] is None for r in rows)
    assert (tmp_path / "report.txt").read_text().strip()
