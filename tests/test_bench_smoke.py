"""Smoke test of experiments.benchmarks.bench_turns: the tiny shape, the first two turns
of the 6-turn workflow, a few generated tokens, the engine's three modes and
HF transformers (no vLLM or llama.cpp); checks the JSON it writes."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from agentkv.experiments.benchmarks import bench_turns  # noqa: E402
from agentkv.experiments.drivers import llamacpp, replay, vllm  # noqa: E402
from agentkv.experiments.drivers.checkpoint import prepare_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

SYSTEMS = ["stateful", "stateless", "block", "hf", "hf-reuse"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_turns")
    res = bench_turns.main([
        "--shape", "tiny", "--workflow", "6", "--max-turns", "2", "--max-gen", "3", "--repeats", "1",
        "--threads", "1", "--systems", ",".join(SYSTEMS), "--out", str(out), "--no-wandb",
    ])
    return out, res


def test_writes_json_plot_and_report(result):
    out, _ = result
    data = json.loads((out / "results.json").read_text())
    for key in ("command", "args", "machine", "model", "workflow", "requests", "systems_ran", "skipped", "results"):
        assert key in data
    assert "bench_turns" in data["command"]
    assert data["machine"]["threads"] == 1
    try:
        import matplotlib  # noqa: F401  (the bench extra)
    except ImportError:
        pass
    else:
        assert (out / "per_turn.png").stat().st_size > 0
    assert (out / "report.txt").read_text().strip()


def test_every_system_ran_the_same_turns(result):
    _, res = result
    assert res["systems_ran"] == SYSTEMS, res["skipped"]
    assert res["skipped"] == {}
    n = len(res["requests"])
    assert n == 2 and res["workflow"]["turns_run"] == 2
    for s in SYSTEMS:
        turns = res["results"][s]["turns"]
        assert len(turns) == n
        for t, r in zip(turns, res["requests"]):
            assert t["latency_s"] > 0
            assert t["generated"] == r["gen"] <= 3
            assert len(t["repeats"]) == 1
        assert res["results"][s]["e2e_s"] == pytest.approx(sum(t["latency_s"] for t in turns))
        assert "median_turn_ratio" in res["results"][s]


def test_stateful_computes_less_than_stateless(result):
    _, res = result
    r = res["results"]
    prompts = [q["prompt"] for q in res["requests"]]
    # Stateless re-prefills every prompt in full; the stateful session only
    # the second turn's delta.
    assert [t["computed"] for t in r["stateless"]["turns"]] == prompts
    assert r["stateful"]["computed_tokens"] < r["stateless"]["computed_tokens"]
    assert r["stateful"]["turns"][1]["reused"] > 0
    # Block-hash reuse matches whole pages only, so never more than the stateful session.
    assert r["block"]["turns"][1]["reused"] <= r["stateful"]["turns"][1]["reused"]
    assert r["block"]["turns"][1]["reused"] % res["args"]["page_size"] == 0
    assert r["hf-reuse"]["computed_tokens"] < r["hf"]["computed_tokens"]


def test_absent_peers_are_skipped_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm, "VLLM_VENV", tmp_path / "no-vllm")
    monkeypatch.setattr(llamacpp, "LLAMACPP_VENV", tmp_path / "no-llamacpp")
    assert "setup_vllm.sh" in vllm.vllm_status()
    assert "setup_llamacpp.sh" in llamacpp.llamacpp_status()
    with pytest.raises(RuntimeError, match="setup_vllm.sh"):
        vllm.start_vllm_server(tmp_path, threads=1)


def test_from_scratch_systems_serve_a_sample_of_turns(tmp_path):
    res = bench_turns.main([
        "--shape", "tiny", "--workflow", "6", "--max-turns", "3", "--max-gen", "2", "--repeats", "1",
        "--threads", "1", "--systems", "stateful,stateless", "--from-scratch-every", "2",
        "--out", str(tmp_path), "--no-wandb",
    ])
    stateful, stateless = (res["results"][s] for s in ("stateful", "stateless"))
    # Turns 2 and 3 (every 2nd, and the last); the stateful session serves all three.
    assert [t["latency_s"] is not None for t in stateless["turns"]] == [False, True, True]
    assert stateless["turns_ran"] == 2 and stateful["turns_ran"] == 3
    assert len(stateless["ratio_per_turn"]) == 2
    ref = sum(t["latency_s"] for t in stateful["turns"][1:])
    assert stateless["e2e_ratio"] == pytest.approx(stateless["e2e_s"] / ref)
    assert "served turns 2, 3 only" in (tmp_path / "report.txt").read_text()


def test_live_replay_replays_the_models_own_replies(tmp_path):
    res = bench_turns.main([
        "--shape", "tiny", "--workflow", "6", "--max-turns", "3", "--max-gen", "4", "--repeats", "1",
        "--threads", "1", "--systems", "stateful,stateless", "--live", "--out", str(tmp_path), "--no-wandb",
    ])
    live = json.loads((tmp_path / "live_workflow.json").read_text())
    reference = replay.workflow("6", 0)
    stateful, stateless = (res["results"][s] for s in ("stateful", "stateless"))
    # Greedy replay of the model's own replies regenerates them: both systems
    # agree, and each turn generates what the live run did (at most 4 tokens).
    assert stateless["greedy_agreement"] == 1.0
    for r in res["requests"]:
        assert 1 <= r["gen"] <= 4
    # The later turns re-send the live replies, not the reference ones.
    served = {}
    for agent in reference.schedule[:3]:
        served[agent] = served.get(agent, 0) + 1
    changed = 0
    for conv, ref in zip(live["conversations"], reference.conversations):
        replies = [m for m in conv["messages"] if m["role"] == "assistant"]
        refs = [m for m in ref.messages if m["role"] == "assistant"]
        n = served.get(conv["agent"], 0)
        assert replies[n:] == refs[n:]  # turns not served keep the reference
        changed += sum(a != b for a, b in zip(replies[:n], refs[:n]))
    assert changed == 3


def test_turns_over_the_models_context_are_left_out(tmp_path):
    from agentkv.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(prepare_checkpoint("tiny", 0))
    wf = replay.workflow("6", 0)
    every = replay.prepare_requests(tokenizer, wf, None, 4)
    limit = sorted(len(r.ids) + r.gen for r in every)[2]
    kept = replay.prepare_requests(tokenizer, wf, None, 4, max_context=limit)
    assert [r.index for r in kept] == [r.index for r in every if len(r.ids) + r.gen <= limit]
    assert 3 <= len(kept) < len(every)
