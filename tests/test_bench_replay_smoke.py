"""Smoke test of experiments.benchmarks.bench_replay: two BFCL agents
replayed against two of our systems (serve.py subprocesses) twice, the
order rotated; every system got the identical stream, every reply exactly
max_tokens long, the servers' counters add up, the report states its
conditions."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("bfcl_eval", reason="BFCL's data and classes come from PyPI's bfcl-eval (installed --no-deps)")

from agentkv.experiments.benchmarks import bench_replay  # noqa: E402
from agentkv.model.default import SMALL_MODEL_DIR  # noqa: E402

pytestmark = pytest.mark.slow

SYSTEMS = ["agentkv", "agentkv-block16"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_replay")
    res = bench_replay.main(["--family", "bfcl-base", "--agents", "2", "--fractions", "1.0", "--repeats", "2",
                             "--systems", ",".join(SYSTEMS), "--max-tokens", "4", "--pause-scale", "0.01",
                             "--threads", "1", "--dtype", "float32", "--model", str(SMALL_MODEL_DIR),
                             "--out", str(out), "--no-wandb"])
    return out, res


def test_every_system_in_every_repeat_in_rotated_order(result):
    _, res = result
    assert [(r["repeat"], r["system"]) for r in res["rows"]] == [
        (0, "agentkv"), (0, "agentkv-block16"), (1, "agentkv-block16"), (1, "agentkv")]
    assert bench_replay.rotation(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_identical_streams_and_equal_generation(result):
    _, res = result
    assert res["streams_identical"] and len({r["stream_digest"] for r in res["rows"]}) == 1
    for r in res["rows"]:
        assert r["errors"] == [] and r["requests"] == r["planned_turns"] > 2
        assert all(t["completion_tokens"] == 4 for a in r["records"] for t in a["turns"])


def test_budget_counters_and_ratios(result):
    out, res = result
    for r in res["rows"]:
        assert r["budget_tokens"] % bench_replay.UNIT == 0
        assert r["longest_request_tokens"] <= r["budget_tokens"] <= r["distinct_tokens"] <= r["working_set_tokens"]
        # What the server computed and what it reused are its whole prompt tokens.
        assert r["computed_tokens"] + r["cached_tokens"] == r["prompt_tokens_server"] == r["prompt_tokens"]
        assert r["recomputed_tokens"] == max(0, r["computed_server"] - r["needed_tokens"])
    by = {s["system"]: s for s in res["summary"]}
    assert by["agentkv"]["ratio"] == 1.0 and by["agentkv"]["repeats"] == 2
    assert by["agentkv-block16"]["job_s_min"] <= by["agentkv-block16"]["job_s_median"] <= by["agentkv-block16"]["job_s_max"]
    # Sessions give our stateful system each turn's server-side timeline; block hashing has none.
    rows = {r["system"]: r for r in res["rows"] if r["repeat"] == 0}
    assert len(rows["agentkv"]["timeline"]) == rows["agentkv"]["requests"] and rows["agentkv-block16"]["timeline"] == []
    report = (out / "report.txt").read_text()
    assert "request streams identical across systems: yes" in report
    assert "of distinct" in report and "TraceLab" in report and "ignore_eos" in report
    assert json.loads((out / "results.json").read_text())["streams_identical"] is True
    assert (out / "bench_replay.png").stat().st_size > 0
