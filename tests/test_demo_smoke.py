"""Smoke tests of the main job (serve.py demo) at a tiny scale, under KV
pressure: BFCL's agents (the default workload) and the generated ones.
Every system finishes every turn with the same KV bytes and no host tier,
the stateful engine computes fewer tokens than re-prefilling every turn, and
the run's folder holds its table, JSON and timeline."""
from __future__ import annotations

import json

import pytest

from agentkv.experiments.benchmarks import demo
from agentkv.model.default import SMALL_MODEL_DIR


def check_rows(res: dict, turns: int) -> dict:
    rows = {r["system"]: r for r in res["rows"]}
    assert list(rows) == list(demo.SYSTEMS)
    for r in rows.values():
        assert r["completed_turns"] == r["planned_turns"] == turns
        assert r["errors"] == []
        assert r["job_s_median"] > 0 and r["host_tier_bytes"] == 0
    # Equal memory: every system the same KV bytes, no host tier beside any.
    assert len({r["kv_bytes"] for r in rows.values()}) == 1
    stateless, stateful = rows["stateless"], rows["stateful"]
    assert stateless["reused_tokens"] == 0 and stateless["computed_tokens"] >= stateless["prompt_tokens"]
    assert 0 < stateful["computed_tokens"] < stateless["computed_tokens"]
    return rows


def test_bfcl_agents_default_workload(tmp_path, capsys):
    pytest.importorskip("bfcl_eval")
    res = demo.main(["--model", str(SMALL_MODEL_DIR), "--agents", "2", "--turns-per-agent", "1", "--max-tokens", "24",
                     "--pause-scale", "0.01", "--kv-fraction", "0.6", "--systems", ",".join(demo.SYSTEMS),
                     "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "2 agents at once: BFCL v4 multi_turn_base agents (1 x GorillaFileSystem, 1 x TradingBot)" in out
    assert "no host tier" in out
    rows = check_rows(res, 2)
    for r in rows.values():
        assert r["jobs_checked"] == 2 and r["requests"] >= 2
    assert json.loads((tmp_path / "results.json").read_text()) == res
    assert set(res["records"]) == set(demo.SYSTEMS)
    assert (tmp_path / "timeline.png").stat().st_size > 0 and (tmp_path / "report.txt").exists()


def test_generated_agents(tmp_path, capsys):
    res = demo.main(["--workload", "generated", "--agents", "3", "--turns-per-agent", "2", "--max-tokens", "8",
                     "--pause-scale", "0.02", "--kv-fraction", "0.6", "--systems", ",".join(demo.SYSTEMS),
                     "--out", str(tmp_path)])
    assert "3 agents at once: generated agents" in capsys.readouterr().out
    rows = check_rows(res, 6)
    # Same replies on every system (greedy, fp32), so the same prompts.
    assert len({r["prompt_tokens"] for r in rows.values()}) == 1


def test_full_sweeps_every_cell(tmp_path, monkeypatch):
    # --full runs the grid of agents x pool fractions (8/16/32 x 30/50/100%); here a small grid.
    monkeypatch.setattr(demo, "FULL_AGENTS", (2,))
    monkeypatch.setattr(demo, "FULL_FRACTIONS", (0.6, 1.0))
    res = demo.main(["--model", str(SMALL_MODEL_DIR), "--workload", "generated", "--full", "--turns-per-agent", "1",
                     "--max-tokens", "4", "--pause-scale", "0", "--systems", "stateful,block-hash", "--out", str(tmp_path)])
    assert [(c["agents"], c["fraction"]) for c in res["cells"]] == [(2, 0.6), (2, 1.0)]
    for cell in res["cells"]:
        assert [r["system"] for r in cell["rows"]] == ["stateful", "block-hash"]
        assert all(r["completed_turns"] == r["planned_turns"] == 2 for r in cell["rows"])
        assert (tmp_path / f"timeline-2-{cell['fraction']:g}.png").stat().st_size > 0
    assert res["cells"][0]["tokens"] < res["cells"][1]["tokens"]
