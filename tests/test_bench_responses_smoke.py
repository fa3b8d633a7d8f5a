"""Smoke test of experiments.benchmarks.bench_responses: the tiny shape, the first three
turns of the 6-turn workflow, a few generated tokens, the two engine sides
(no vLLM); checks the JSON it writes and that both sides did the same work."""
from __future__ import annotations

import json

import pytest

from agentkv.experiments.benchmarks import bench_responses

pytestmark = pytest.mark.slow

SYSTEMS = ["responses", "chat"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_responses")
    res = bench_responses.main([
        "--shape", "tiny", "--workflow", "6", "--max-turns", "3", "--max-gen", "3", "--threads", "1",
        "--systems", ",".join(SYSTEMS), "--out", str(out),
    ])
    return out, res


def test_writes_json_and_report(result):
    out, res = result
    data = json.loads((out / "results.json").read_text())
    assert data["systems_ran"] == SYSTEMS and data["skipped"] == {}
    assert "bench_responses" in data["command"] and len(data["turns"]) == 3
    assert (out / "report.txt").read_text().strip()


def test_both_sides_serve_the_same_conversation(result):
    _, res = result
    assert all(res["engine_replies_agree"])
    responses, chat = (res["results"][s]["turns"] for s in SYSTEMS)
    for turn, r, c in zip(res["turns"], responses, chat):
        assert r["prompt"] == c["prompt"] and r["generated"] == c["generated"] == turn["gen"]
        assert r["computed"] == r["prompt"] - r["cached"]
        if turn["agent_turn"]:  # a continuation: only the new items go over the wire, and only they are computed
            assert r["bytes"] < c["bytes"]
            assert r["cached"] > 0
