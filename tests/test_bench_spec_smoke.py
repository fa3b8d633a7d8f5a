"""Smoke test of experiments.benchmarks.bench_spec on two short turns of the trained
agent model: it writes its results, report and plot, every drafter's greedy
output is the plain one, and speculation takes fewer decode forwards
(speeds are the benchmark's to report, not this test's to assert)."""
from __future__ import annotations

import json

import pytest

from agentkv.experiments.benchmarks import bench_spec

pytestmark = pytest.mark.slow


def test_writes_results_and_every_drafter_is_greedy_identical(tmp_path):
    bench_spec.main(["--turns", "2", "--max-tokens", "32", "--repeats", "1", "--kv-cache-mb", "32", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    summary = results["summary"]
    assert list(summary) == list(bench_spec.MODES)
    assert all(m["identical"] for m in summary.values())
    assert summary["none"]["tokens_per_forward"] == 1.0
    assert summary["suffix+forced"]["decode_steps"] < summary["none"]["decode_steps"]
    assert set(results["verify_cost"]) == {str(k) for k in bench_spec.VERIFY_KS}
    assert sum(v["tokens"] for v in summary["none"]["by_kind"].values()) == summary["none"]["generated"]
    assert set(results["replays"]) == set(bench_spec.REPLAYS) and all(v >= 1 for v in results["replays"].values())
    assert (tmp_path / "report.txt").read_text().strip()
