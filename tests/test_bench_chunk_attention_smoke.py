"""Smoke test of experiments.benchmarks.bench_chunk_attention on tiny shapes: a row per
(dtype, threads, shape) with both paths timed, a prefill row per (dtype,
threads), and its report (timings are the benchmark's, not this test's)."""
from __future__ import annotations

import json

import pytest

from agentkv.experiments.benchmarks import bench_chunk_attention
from agentkv.kernels import cpu_chunk_attention
from tests.cpu_kernels import require_built

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _built():
    require_built(cpu_chunk_attention)  # a failed build fails on x86


def test_writes_attention_and_prefill_rows(tmp_path):
    bench_chunk_attention.main(["--shape", "tiny", "--shapes", "40x0,64x100", "--dtypes", "float32", "--threads", "1",
                                "--repeats", "1", "--prefill-tokens", "600", "--prefill-repeats", "1",
                                "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    assert [(r["chunk"], r["cached"]) for r in res["attention"]] == [(40, 0), (64, 100)]
    assert all(r["kernel_ms"] > 0 and r["reference_ms"] > 0 for r in res["attention"])
    (row,) = res["prefill"]
    assert row["tokens"] == 600 and row["kernel_s"] > 0 and row["reference_s"] > 0
    assert cpu_chunk_attention.available()  # the baseline's switch is put back
    assert "speedup" in (tmp_path / "report.txt").read_text()
