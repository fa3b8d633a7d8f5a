"""The benchmarks' shared drivers and report writer: the peer protocol over
a stand-in driver, this engine's server as a subprocess (health, metrics,
stop), /metrics parsing, and every output publish writes."""
from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from agentkv.experiments.drivers.peer import PeerSystem
from agentkv.experiments.drivers.servers import COUNTERS, ServerProcess, parse_metrics, start_engine_server
from agentkv.experiments.drivers.system import ROOT, Request
from agentkv.experiments.report import WandbRun, publish, pyplot, save_figure
from agentkv.model.default import SMALL_MODEL_DIR

STAND_IN_DRIVER = """
import sys
sys.path.insert(0, {peers!r})
from peer_protocol import open_replies, read_spec, serve

reply = open_replies()
spec = read_spec()
print("noise on fd 1")
reply({{"ready": True, "echo": spec["x"]}})
serve(reply, {{
    "begin": lambda msg: {{"ok": True}},
    "turn": lambda msg: {{"latency_s": 0.5, "prefill_s": 0.1, "decode_s": 0.4, "cached_tokens": 2,
                         "generated": msg["gen"], "token_ids": list(range(msg["gen"]))}},
}})
"""


def test_a_peer_is_served_over_json_lines(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(STAND_IN_DRIVER.format(peers=str(ROOT / "experiments" / "drivers" / "peers")))
    log = tmp_path / "peers.log"
    peer = PeerSystem("stand-in", [sys.executable, str(script)], dict(os.environ), {"x": 7}, log, timeout=60)
    assert peer.info["ready"] and peer.info["echo"] == 7 and peer.info["startup_s"] > 0
    peer.begin()
    row = peer.turn(Request(0, "a", 0, [], [], [5, 6, 7, 8], 3, 3))
    assert (row["computed"], row["reused"], row["generated"], row["token_ids"]) == (2, 2, 3, [0, 1, 2])
    with pytest.raises(RuntimeError, match="unknown op"):
        peer._call({"op": "nope"})
    peer.close()
    assert peer.proc.returncode == 0
    assert "noise on fd 1" in log.read_text()  # anything but replies goes to the log


def test_metrics_are_summed_over_label_sets():
    text = "\n".join([
        "# TYPE vllm:prefix_cache_hits counter",
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0',
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 12.0',
        "vllm:num_preemptions_total 2",
        'vllm:request_queue_time_seconds_bucket{le="+Inf"} 9',
        "vllm:request_queue_time_seconds_count 9",
        "agentkv_kv_pages_free 1.5e3",
    ])
    assert parse_metrics(text) == {"vllm:prefix_cache_hits_total": 42.0, "vllm:num_preemptions_total": 2.0,
                                   "vllm:request_queue_time_seconds_count": 9.0, "agentkv_kv_pages_free": 1500.0}


def test_a_server_that_exits_before_it_is_ready_says_why(tmp_path):
    cmd = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3") as e:
        ServerProcess(cmd, 1, log=tmp_path / "s.log", startup_timeout=60)
    assert "no model here" in str(e.value)


@pytest.mark.slow
def test_the_engine_server_runs_as_a_subprocess(tmp_path):
    with start_engine_server(SMALL_MODEL_DIR, threads=1, extra_args=["--kv-cache-gb", "0.05"],
                             log=tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": "You are a helpful agent. " * 20}, {"role": "user", "content": "hi"}]
        before = server.counters()
        assert set(before) == set(COUNTERS)
        for _ in range(2):  # the second finds the first's prompt in the prefix cache
            client.chat.completions.create(model="agent-8m", messages=messages, max_tokens=2, temperature=0.0)
        after = server.counters()
        assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
        assert after["vllm:prefix_cache_hits_total"] > before["vllm:prefix_cache_hits_total"]
        assert 0 < server.metrics()["agentkv_generated_tokens_total"] <= 4
    assert server.proc.poll() is not None
    with pytest.raises((urllib.error.URLError, OSError)):
        urllib.request.urlopen(server.url + "/health", timeout=5)


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot(results["xs"])
    save_figure(fig, path)


def no_matplotlib(results: dict, path: Path) -> None:
    raise ImportError("No module named 'matplotlib'")


def test_publish_writes_every_output(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("wandb")
    results = {"xs": [3, 1, 2]}
    run = WandbRun("test_drivers", {"seed": 0}, {"e2e_s": 1.5}, history=[{"turn": 1, "latency_s": 0.5}],
                   tables={"rows": (["a", "b"], [[1, 2]])})
    publish(tmp_path, results, "the table", plots={"a.png": plot, "b.png": no_matplotlib}, wandb=run)
    printed = capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert (tmp_path / "report.txt").read_text() == "the table\n"
    assert (tmp_path / "a.png").stat().st_size > 0 and not (tmp_path / "b.png").exists()
    assert "the table" in printed and "plot skipped: No module named 'matplotlib'" in printed
    assert f"wandb offline run in {tmp_path}/wandb" in printed
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert f"wrote {tmp_path}/results.json, report.txt, a.png" in printed


def test_vllms_worker_gets_every_core_of_the_comparison(tmp_path, monkeypatch):
    # vLLM's server otherwise leaves one core to its API process: on a 2-core
    # machine its model ran on one core while ours ran on two.
    from agentkv.experiments.drivers import vllm

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").touch()
    monkeypatch.setattr(vllm, "VLLM_VENV", tmp_path)
    monkeypatch.setattr(vllm, "TCMALLOC", tmp_path / "absent.so")
    env = vllm.vllm_env(2, 3)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert (env["OMP_NUM_THREADS"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("2", "3")
    assert env["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")
    # TCMalloc, as vLLM's CPU docs recommend, goes first where it is installed.
    (tmp_path / "tcmalloc.so").touch()
    monkeypatch.setattr(vllm, "TCMALLOC", tmp_path / "tcmalloc.so")
    assert vllm.vllm_env(2, 3)["LD_PRELOAD"] == f"{tmp_path / 'tcmalloc.so'}:{tmp_path / 'lib' / 'libiomp5.so'}"
