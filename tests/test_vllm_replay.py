"""The replay against vLLM's own server, as the benchmark runs it (compiled,
its block size, the budget as its block count, prefix caching, ignore_eos),
where its venv exists (bash experiments/drivers/peers/setup_vllm.sh)."""
from __future__ import annotations

import argparse

import pytest

from agentkv.experiments.drivers.vllm import vllm_status

pytestmark = pytest.mark.skipif(vllm_status() is not None, reason=f"vLLM peer not installed: {vllm_status()}")


def test_vllm_serves_the_replay_with_equal_generation_and_its_budget(tmp_path):
    from agentkv.experiments.benchmarks import bench_replay
    from agentkv.experiments.benchmarks.bench_agents import model_config
    from agentkv.model.default import SMALL_MODEL_DIR
    from agentkv.model.loader import load_tokenizer

    pytest.importorskip("bfcl_eval")
    args = argparse.Namespace(model=SMALL_MODEL_DIR, dtype="float32", threads=2, max_num_batched_tokens=2048,
                              max_num_seqs=256, prefill_chunk=512, max_tokens=6, pause_scale=0.0, seed=0,
                              vllm_block_size=32)
    traces = bench_replay.build_traces("bfcl-base", 2, 0, 1, None)
    cell = bench_replay.cell_for(traces, load_tokenizer(SMALL_MODEL_DIR), args, model_config(SMALL_MODEL_DIR), 1.0)
    row = bench_replay.run_system("vllm", traces, args, cell, 0, tmp_path)
    assert row["errors"] == [] and row["requests"] == cell["requests"]
    assert all(t["completion_tokens"] == 6 for a in row["records"] for t in a["turns"])
    # Its prefix cache served the agents' histories; its KV is the budget in its own blocks.
    assert row["prefix_hits"] > 0 and row["computed_server"] < row["prompt_tokens"]
    assert row["vllm_kv_log"] and f"{cell['budget_tokens'] // 32 * 32:,}" in row["vllm_kv_log"]
