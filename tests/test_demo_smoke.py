"""The main job (serve.py demo) is a preset of the replay benchmark: its
flags map onto bench_replay's, and a tiny run of it (two long-context BFCL
agents on the 8M model) finishes with identical streams on both systems
and a report that states its conditions."""
from __future__ import annotations

import argparse

import pytest

from agentkv.experiments.benchmarks import demo
from agentkv.model.default import SMALL_MODEL_DIR

pytestmark = pytest.mark.slow


def argv_of(**overrides) -> list[str]:
    defaults = {"agents": 4, "fraction": 0.46, "repeats": 1, "max_tokens": 16, "pause_scale": 0.25,
                "max_positions": 16384, "dtype": "auto", "model": None, "threads": 2, "seed": 0, "full": False,
                "peers": [], "out": None}
    return demo.replay_argv(argparse.Namespace(**(defaults | overrides)))


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_default_job_is_the_stateful_engine_against_block_hashing_under_pressure():
    argv = argv_of()
    assert flag(argv, "--family") == "bfcl-long" and flag(argv, "--roles") == demo.ROLES
    assert flag(argv, "--systems") == "agentkv,agentkv-block16"
    assert (flag(argv, "--agents"), flag(argv, "--fractions"), flag(argv, "--repeats")) == ("4", "0.46", "1")
    assert flag(argv, "--pause-scale") == "0.25" and flag(argv_of(full=True), "--pause-scale") == "1"
    assert "--model" not in argv and "--out" not in argv


def test_full_sweeps_every_ablation_and_peers_add_vllm():
    argv = argv_of(full=True)
    assert (flag(argv, "--agents"), flag(argv, "--fractions"), flag(argv, "--repeats")) == ("8,16,32", "0.25,0.5,1.0",
                                                                                            "3")
    systems = flag(argv, "--systems").split(",")
    assert systems[0] == "agentkv" and "agentkv-lru" in systems and "agentkv-block128" in systems
    assert "vllm" not in systems and "vllm" in flag(argv_of(full=True, peers=["vllm"]), "--systems").split(",")
    assert flag(argv_of(peers=["vllm"]), "--systems") == "agentkv,agentkv-block16,vllm"
    assert flag(argv_of(model="m", out="o"), "--model") == "m"


def test_a_tiny_demo_runs(tmp_path, capsys):
    pytest.importorskip("bfcl_eval")
    res = demo.main(["--model", str(SMALL_MODEL_DIR), "--agents", "2", "--fraction", "1.0", "--max-tokens", "4",
                     "--pause-scale", "0.01", "--dtype", "float32", "--threads", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "C++ CPU kernels for" in out and "request streams identical across systems: yes" in out
    assert [r["system"] for r in res["rows"]] == ["agentkv", "agentkv-block16"]
    assert all(r["errors"] == [] and r["requests"] == r["planned_turns"] for r in res["rows"])
    assert (tmp_path / "report.txt").exists() and (tmp_path / "bench_replay.png").stat().st_size > 0
