"""Smoke test of experiments.benchmarks.bench_decode: the tiny shape, our engine only,
two short contexts and a few decode tokens; checks the table, the JSON and
the plot it writes (speeds are the benchmark's to report, not this test's)."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from agentkv.experiments.benchmarks import bench_decode
from agentkv.experiments.drivers import llamacpp, vllm

pytestmark = pytest.mark.slow

CONTEXTS = (48, 96)
TOKENS, REPEATS = 5, 2


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_decode")
    res = bench_decode.main([
        "--shape", "tiny", "--dtypes", "float32", "--threads", "1", "--contexts", ",".join(map(str, CONTEXTS)),
        "--systems", "ours", "--decode-tokens", str(TOKENS), "--repeats", str(REPEATS), "--out", str(out),
        "--no-wandb", "--max-foreign", "1000",  # the shared machine's other work does not hold up the test
        "--gap", "0",  # one system: no other system's spinning threads to wait out before a request
    ])
    return out, res


def test_writes_json_report_and_plot(result):
    out, res = result
    data = json.loads((out / "results.json").read_text())
    assert data["rows"] == json.loads(json.dumps(res["rows"]))
    assert "experiments.benchmarks.bench_decode" in data["command"]
    text = (out / "report.txt").read_text()
    assert "ours ms" in text and "read GB/s" in text
    assert all(f" {c} " in text for c in CONTEXTS)
    assert (out / "decode.png").stat().st_size > 0


def test_one_row_per_context_with_sane_numbers(result):
    _, res = result
    assert [(r["dtype"], r["threads"], r["context"]) for r in res["rows"]] == [("float32", 1, c) for c in CONTEXTS]
    for r in res["rows"]:
        ours = r["systems"]["ours"]
        # Every timed request gives TOKENS - 1 steps (intervals between tokens).
        assert ours["steps"] == REPEATS * (TOKENS - 1)
        assert 0 < ours["p10_ms"] <= ours["ms_per_token"] <= ours["p90_ms"] < 10_000 and math.isfinite(ours["mean_ms"])
        assert ours["prefill_s"] > 0 and ours["greedy_agree"] == 1.0
        assert ours["repeat_reused_tokens"] == r["context"]
        assert r["read_GBps"] > 0 and 0 < r["bound_ms"] < ours["ms_per_token"] * 100
        assert r["kv_MB"] > 0 and r["weights_MB"] > 0
        assert set(r["systems"]) == {"ours"} and "ours_over_vllm" not in r
    # K/V grows with the context, the weights do not.
    a, b = res["rows"]
    assert b["kv_MB"] > a["kv_MB"] and b["weights_MB"] == a["weights_MB"]


def test_steps_are_the_intervals_between_tokens():
    assert bench_decode.steps_of({"token_s": [0.5, 0.75, 1.25]}) == [0.25, 0.5]


def test_prompts_are_reproducible_and_avoid_special_tokens():
    ids = bench_decode.prompt_ids(50, 200, 0, {0, 1})
    assert ids == bench_decode.prompt_ids(50, 200, 0, {0, 1}) and len(ids) == 200
    assert min(ids) >= 2 and max(ids) < 50
    assert ids != bench_decode.prompt_ids(50, 200, 1, {0, 1})


def test_absent_peers_are_skipped_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm, "VLLM_VENV", tmp_path / "no-vllm")
    monkeypatch.setattr(llamacpp, "LLAMACPP_VENV", tmp_path / "no-llamacpp")
    res = bench_decode.main(["--shape", "tiny", "--dtypes", "float32", "--threads", "1", "--contexts", "32",
                             "--systems", "ours,vllm,llamacpp", "--decode-tokens", "3", "--repeats", "1",
                             "--max-foreign", "1000", "--gap", "0",
                             "--out", str(tmp_path / "out"), "--no-wandb"])
    assert "setup_vllm.sh" in res["skipped"]["vllm"] and "setup_llamacpp.sh" in res["skipped"]["llamacpp"]
    assert set(res["rows"][0]["systems"]) == {"ours"}
    assert "skipped vllm" in (tmp_path / "out" / "report.txt").read_text()


def test_engine_decode_repeats_the_same_greedy_decode_from_the_kept_prompt():
    from agentkv import Engine
    from agentkv.experiments.common import random_model
    from agentkv.experiments.drivers.engine_local import EngineDecode

    model = random_model("tiny", torch.float32, seed=3)
    ids = bench_decode.prompt_ids(model.cfg.vocab_size, 40, 0, set())
    ours = EngineDecode(model, num_pages=32, page_size=8)
    first, again = ours.decode(ids, 6, "a"), ours.decode(ids, 6, "a")
    with Engine(model, None, page_size=8, num_pages=32).session() as s:
        s.append(ids)
        plain = s.generate(max_tokens=6, ignore_eos=True, speculative=False)
    assert first["token_ids"] == again["token_ids"] == plain
    assert len(again["token_s"]) == 6 and again["token_s"] == sorted(again["token_s"])
    # The kept session is cut back to its prompt; another prompt under the same name is refused.
    assert ours.sessions["a"].tokens == ids
    with pytest.raises(ValueError):
        ours.decode(ids[:-1], 2, "a")
    ours.close()


def test_each_timed_request_records_who_used_the_cpus(result):
    _, res = result
    for r in res["rows"]:
        ours = r["systems"]["ours"]
        assert len(ours["usage"]) == REPEATS
        u = ours["usage_median"]
        # Alone, nothing else of the benchmark's ran; the rest of the machine is not ours to assert on.
        assert u["others_cores"] == 0 and u["majflt"] >= 0 and u["nonvoluntary"] >= 0
        assert u["cpu_per_wall"] is not None and u["foreign_cores"] >= 0 and u["steal_share"] >= 0


def test_grouped_schedule_times_each_system_back_to_back(tmp_path):
    caller_threads = torch.get_num_threads()
    res = bench_decode.main(["--shape", "tiny", "--dtypes", "float32", "--threads", "1", "--contexts", "32",
                             "--systems", "ours", "--decode-tokens", "3", "--repeats", "2", "--schedule", "grouped",
                             "--settle", "0.5", "--retries", "1", "--prefill-threads", "2", "--gap", "0",
                             "--out", str(tmp_path / "out"), "--no-wandb"])
    assert res["schedule"] == "grouped"
    ours = res["rows"][0]["systems"]["ours"]
    # A request redone for outside work still counts once.
    assert ours["steps"] == 2 * (3 - 1) and len(ours["usage"]) == 2 and 0 <= ours["redone"] <= 2
    assert torch.get_num_threads() == caller_threads  # the bench gives the caller's threads back
    assert "preempted" in (tmp_path / "out" / "report.txt").read_text()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two vCPUs to tell a pin from none")
def test_pin_puts_every_timed_request_on_the_given_vcpu_and_the_prefill_on_all(tmp_path, monkeypatch):
    from agentkv.experiments.drivers.engine_local import EngineDecode

    every, seen = os.sched_getaffinity(0), []
    real = EngineDecode.decode

    def decode(self, ids, gen, agent):
        seen.append(os.sched_getaffinity(0))
        return real(self, ids, gen, agent)

    monkeypatch.setattr(EngineDecode, "decode", decode)
    pin = max(every)
    res = bench_decode.main(["--shape", "tiny", "--dtypes", "float32", "--threads", "1", "--contexts", "32",
                             "--systems", "ours", "--decode-tokens", "3", "--repeats", "2", "--pin", str(pin),
                             "--prefill-threads", "2", "--max-foreign", "1000", "--gap", "0",
                             "--out", str(tmp_path / "out"), "--no-wandb"])
    # seen[0] is start_systems' warm-up, seen[1] the prefill (2 threads: every vCPU), then the timed ones.
    assert seen[1] == every and seen[2:] == [{pin}, {pin}]
    assert res["rows"][0]["pin"] == [pin] and os.sched_getaffinity(0) == every
    assert f" {pin} " in (tmp_path / "out" / "report.txt").read_text().splitlines()[2]
    busy = res["rows"][0]["systems"]["ours"]["usage_median"]["vcpu_busy"]
    assert set(busy) == every and all(b >= 0 for b in busy.values())


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs vCPUs 0 and 1")
def test_pin_refuses_bad_lists_and_fewer_vcpus_than_threads(tmp_path):
    from agentkv.experiments.drivers.affinity import parse_cpus

    assert parse_cpus("0") == [0] and parse_cpus(" 0 ") == [0] and parse_cpus("1,0") == parse_cpus("0-1") == [0, 1]
    for bad in ("", "x", "0-", "1-0", str(max(os.sched_getaffinity(0)) + 1)):
        with pytest.raises(ValueError):
            parse_cpus(bad)
    with pytest.raises(SystemExit, match="fewer vCPUs"):
        bench_decode.main(["--shape", "tiny", "--dtypes", "float32", "--threads", "2", "--contexts", "32",
                           "--systems", "ours", "--pin", "0", "--out", str(tmp_path / "out"), "--no-wandb"])
    assert not (tmp_path / "out").exists()
