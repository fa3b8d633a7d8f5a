"""Smoke test of experiments.benchmarks.bench_agents: two agents, two live turns
each, short replies and pauses, against this engine's server in a
subprocess as each of its systems (vLLM skipped); checks the JSON."""
from __future__ import annotations

import json
import math

import pytest

from agentkv.experiments.benchmarks import bench_agents
from agentkv.experiments.workloads.agent_runs import AgentRecord, TurnRecord, summarize

pytestmark = pytest.mark.slow

SYSTEMS = ["agentkv", "agentkv-noadmit", "agentkv-lru"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_agents")
    # A pool that holds the whole working set: no preemption, so every prompt
    # token is either reused or computed exactly once.
    bench_agents.main(["--agents", "2", "--turns-per-agent", "2", "--max-tokens", "8", "--pause-scale", "0.02",
                       "--kv-fraction", "1.0", "--threads", "1", "--systems", ",".join(SYSTEMS), "--out", str(out),
                       "--no-wandb"])
    return out, json.loads((out / "results.json").read_text())


def test_a_row_per_system_with_every_turn_done(result):
    _, data = result
    assert [r["system"] for r in data["rows"]] == SYSTEMS
    for r in data["rows"]:
        assert r["agents"] == 2
        assert r["planned_turns"] == 4
        assert r["completed_turns"] == 4
        assert r["errors"] == []
        assert 0 < r["tokens"] <= r["working_set_tokens"]
        assert r["job_s_median"] >= r["turn_s_p50"] > 0
        assert len(r["records"]) == 2 and all(len(a["turns"]) == 2 for a in r["records"])
        # Equal memory: the pool's bytes alone, no host tier beside it.
        assert r["kv_bytes"] == r["tokens"] * r["token_bytes"] and r["tier_bytes"] == 0


def test_each_turn_has_its_server_side_timeline(result):
    _, data = result
    for r in data["rows"]:
        assert len(r["timeline"]) == 4
        for t in r["timeline"]:
            assert t["prefill_s"] > 0 and t["decode_s"] > 0 and t["queued_s"] >= 0 and t["other_s"] >= 0
            assert t["queued_s"] + t["prefill_s"] + t["decode_s"] <= t["latency_s"] + 1e-6
        assert r["repeat_preemptions"] == 0

def test_tokens_add_up_with_the_servers_counters(result):
    _, data = result
    for r in data["rows"]:
        assert r["prompt_tokens_server"] == r["prompt_tokens"]
        assert r["cached_tokens"] == r["reused_tokens"]
        assert r["preemptions"] == 0
        assert r["computed_tokens"] + r["reused_tokens"] == r["prompt_tokens"]
        # A pool that holds everything recomputes nothing the turns did not add, but for the
        # shared prefix when both agents' first prompts compute it before either publishes it.
        assert r["recomputed_tokens"] == max(0, r["computed_server"] - r["needed_tokens"])
        assert r["recomputed_tokens"] <= r["shared_prefix_tokens"] + r["agents"]
        # The agents share a system prompt and tools, and each re-sends its history: something is reused.
        assert 0 < r["reused_tokens"] < r["prompt_tokens"]
        assert r["prefix_queries"] >= r["prefix_hits"] > 0


def test_every_engine_system_writes_the_same_replies(result):
    # fp32 results do not depend on batch or page placement: retention and
    # admission change what is recomputed or when, never what is said.
    _, data = result
    for other in data["rows"][1:]:
        assert other["replies_equal_to"] == "agentkv"
        assert other["replies_equal"] == other["completed_turns"]


def test_writes_the_plot(result):
    out, _ = result
    pytest.importorskip("matplotlib")
    assert (out / "bench_agents.png").stat().st_size > 0
    assert (out / "bench_agents_timeline.png").stat().st_size > 0


def test_bfcl_agents_over_http(tmp_path):
    """BFCL's agents through the server: tools run on BFCL's classes, end states checked, requests counted."""
    pytest.importorskip("bfcl_eval")
    bench_agents.main(["--workload", "bfcl", "--agents", "3", "--turns-per-agent", "1", "--max-tokens", "16",
                       "--pause-scale", "0.01", "--kv-fraction", "0.6", "--threads", "1", "--systems", "agentkv",
                       "--out", str(tmp_path), "--no-wandb"])
    [row] = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["errors"] == [] and row["completed_turns"] == row["planned_turns"] == 3
    assert row["jobs_checked"] == 3 and row["requests"] == len(row["timeline"]) >= 3
    # Two of the three agents share a role: its function docs (thousands of tokens) held once.
    assert row["distinct_tokens"] < row["working_set_tokens"] and row["tokens"] % bench_agents.BLOCK == 0
    assert row["computed_tokens"] + row["reused_tokens"] == row["prompt_tokens"]


def test_under_pressure_every_turn_is_served(tmp_path):
    """A pool smaller than the agents' distinct working set: the turns wait, are evicted or
    recomputed, but none fails (a turn once could, with KVCapacityError, when
    a request found the pool held by others), and retention or admission
    changes when a reply comes, never what it says."""
    systems = ["agentkv", "agentkv-noadmit", "agentkv-lru"]
    bench_agents.main(["--agents", "4", "--turns-per-agent", "2", "--max-tokens", "8", "--pause-scale", "0.02",
                       "--kv-fraction", "0.5", "--threads", "1", "--systems", ",".join(systems), "--out", str(tmp_path),
                       "--no-wandb"])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    for r in rows:
        assert r["errors"] == [] and r["completed_turns"] == r["planned_turns"] == 8
        assert r["tokens"] < r["distinct_tokens"]  # the pool cannot hold every agent's KV at once
        assert r["computed_tokens"] + r["reused_tokens"] == r["prompt_tokens"]
    for other in rows[1:]:
        assert other["replies_equal"] == other["completed_turns"]


def test_vllms_kv_line_is_the_last_servers(tmp_path):
    # One log per system and agent count: each budget's server appends to it.
    log = tmp_path / "vllm-apc-8.log"
    log.write_text("".join(f"(EngineCore pid={p}) INFO [kv_cache_utils.py:2327] CPU KV cache size: {n} tokens, "
                           f"Maximum concurrency for 16,384 tokens per request: 1.73x\nother line\n"
                           for p, n in ((1, "28,288"), (2, "47,104"))))
    assert bench_agents.vllm_kv_line(log).startswith("CPU KV cache size: 47,104 tokens")
    log.write_text("no such line\n")
    assert bench_agents.vllm_kv_line(log) is None


def _row(system: str, repeat: int, job: float, errors: int = 0) -> dict:
    return {"system": system, "agents": 16, "fraction": 0.3, "repeat": repeat, "job_s_median": job,
            "job_s_p90": job + 1, "first_request_s_median": job / 2, "later_requests_s_median": job / 4,
            "turn_s_p50": job / 10, "wall_s": job + 5, "errors": ["e"] * errors,
            "prefix_hits": 9.0, "prefix_queries": 10.0}


def test_repeats_give_medians_and_the_median_of_each_repeats_ratio():
    # The ratio is taken within a repeat (systems side by side), then the median over repeats:
    # 3.0, 1.5 and 2.0 give 2.0, not the ratio of the medians (30 / 10 = 3.0).
    rows = [_row("agentkv", 0, 10.0), _row("vllm-apc", 0, 30.0, errors=1),
            _row("agentkv", 1, 20.0), _row("vllm-apc", 1, 30.0),
            _row("agentkv", 2, 5.0), _row("vllm-apc", 2, 10.0)]
    ours, theirs = bench_agents.over_repeats(rows)
    assert (ours["system"], ours["repeats"], ours["job_s_median"], ours["ratio_to_first"]) == ("agentkv", 3, 10.0, 1.0)
    assert theirs["first"] == "agentkv" and theirs["job_s_each"] == [30.0, 30.0, 10.0]
    assert theirs["job_s_median"] == 30.0 and theirs["ratio_to_first"] == 2.0 and theirs["errors"] == 1
    assert theirs["hit_rate"] == 0.9
    assert (theirs["first_request_s_median"], theirs["later_requests_s_median"]) == (15.0, 7.5)  # 30 / 2, 30 / 4
    assert [r[0] for r in bench_agents.repeat_rows([ours, theirs])] == ["agentkv", "vllm-apc"]
    assert bench_agents.label(rows[2]) == "agentkv r1" and bench_agents.label(rows[0]) == "agentkv"


def test_a_jobs_first_request_and_its_later_ones_are_told_apart():
    # Per agent: its first request's latency, and the sum of its later ones'; then the median over
    # agents. An agent whose job failed counts in neither (as in job s p50).
    def agent(name, latencies, error=None):
        turns = [TurnRecord(name, i, lat, 0.0) for i, lat in enumerate(latencies)]
        turns[-1].error = error
        return AgentRecord(name, 2, sum(latencies), turns)

    s = summarize([agent("a", [10.0, 1.0, 2.0]), agent("b", [12.0, 4.0]), agent("c", [20.0, 1.0, 1.0, 1.0]),
                   agent("d", [30.0, 9.0], error="HTTP 500")], wall_s=40.0)
    assert s["first_request_s_median"] == 12.0  # of 10, 12, 20
    assert s["later_requests_s_median"] == 3.0  # of 3, 4, 3
    assert s["job_s_median"] == 16.0  # of 13, 16, 23
    empty = summarize([], wall_s=1.0)
    assert math.isnan(empty["first_request_s_median"]) and math.isnan(empty["later_requests_s_median"])
