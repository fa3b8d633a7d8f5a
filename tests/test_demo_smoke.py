"""Smoke test of the demo's default shape (many agents with tool pauses,
in-process) at a tiny scale: every system finishes every turn, and the
stateful engine computes fewer tokens than re-prefilling every turn."""
from __future__ import annotations

import json

from agentkv.experiments.benchmarks import demo


def test_many_agents_default_shape(tmp_path, capsys):
    path = tmp_path / "demo.json"
    # Under pressure: a pool that holds well under the agents' working set.
    res = demo.main(["--agents", "3", "--turns-per-agent", "2", "--max-tokens", "8", "--pause-scale", "0.02",
                     "--kv-fraction", "0.6", "--json", str(path)])
    header = capsys.readouterr().out
    assert "3 agents at once" in header and "of their working set" in header
    assert json.loads(path.read_text()) == res
    rows = {r["system"]: r for r in res["rows"]}
    assert list(rows) == list(demo.SYSTEMS)
    for r in rows.values():
        assert r["completed_turns"] == r["planned_turns"] == 6
        assert r["errors"] == []
        assert r["job_s_median"] > 0
    # Equal memory: every system the same KV bytes, no host tier beside any.
    assert len({r["kv_bytes"] for r in rows.values()}) == 1
    # Same replies on every system (greedy, fp32), so the same prompts.
    assert len({r["prompt_tokens"] for r in rows.values()}) == 1
    stateless, stateful = rows["stateless"], rows["stateful"]
    assert stateless["reused_tokens"] == 0 and stateless["computed_tokens"] >= stateless["prompt_tokens"]
    assert 0 < stateful["computed_tokens"] < stateless["computed_tokens"]
