"""Smoke test of experiments.benchmarks.bench_replicas: two agents, two turns each,
against two replicas with affinity, with a kill mid-way and as Responses API
conversations without X-Session-Id; checks that every turn was done and what
the kill row reports."""
from __future__ import annotations

import json

import pytest

from agentkv.experiments.benchmarks import bench_replicas

pytestmark = pytest.mark.slow


def test_affinity_and_a_kill_complete_every_turn(tmp_path):
    bench_replicas.main(["--agents", "2", "--turns-per-agent", "2", "--max-tokens", "8", "--pause-scale", "0.02",
                         "--setups", "affinity,kill,responses_any", "--out", str(tmp_path)])
    rows = {r["setup"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    for r in rows.values():
        assert r["completed_turns"] == r["planned"] == 4 and r["errors"] == []
    kill = rows["kill"]
    assert list(kill["per_replica"]) == ["1"]  # the survivor's counters only
    if kill["victims"]:  # the ring may have put both agents on the survivor
        assert kill["recovery_s"] is not None and kill["recovery_s"] > 0
    assert bench_replicas.recomputed(kill, rows["affinity"]) >= 0
    assert "recovery" in (tmp_path / "report.txt").read_text()
    assert all(v["restored"] >= 0 for v in rows["responses_any"]["per_replica"].values())
