"""Many agents, tool pauses, a full KV pool: N agents run live tool-calling
jobs at once over HTTP against each system, every system with the same KV
memory in all, a fraction of the agents' working set.

Each agent is a thread with the real openai client. --workload generated
(the default): its turns, pauses and replies are
experiments/workloads/agent_runs.py's (live: the model's own replies in the
history, the workload's tool results, seeded log-normal pauses per tool
name). --workload bfcl: BFCL v4's multi-turn conversations, live, every
tool call run on BFCL's own classes and each agent's end state checked
(experiments/workloads/bfcl_agents.py; pauses per tool class). A model
that is not an HF checkpoint (a GGUF, an adapter over a base, such as the
embedded default) is exported once to one, dequantized and merged, before
anything is timed, and every system serves that same checkpoint. The working set is the sum over agents of their largest prompt +
reply in tokens; the KV budget is --kv-fraction of it (a comma list sweeps),
rounded down to whole 128-token blocks, the same bytes for every system. On
a CPU a host tier is the same RAM as the pool, so ours has none (its
--kv-cache-gb is the total) unless --offload-gb adds one, which the table
then counts in its KV bytes:

- agentkv: serve.py with --kv-retention tool and program admission (agents
  admitted whole while their KV fits), a session_id per agent.
- agentkv-noadmit: the same without program admission (the ablation).
- agentkv-lru: --kv-retention lru, no admission: the plain prefix-cache
  policy on our engine.
- vllm-apc: vLLM-CPU's own OpenAI server (.venv-vllm), automatic prefix
  caching, hermes tool parser, the budget as --num-gpu-blocks-override (its
  log line "CPU KV cache size: N tokens" is kept in the results).

Same weights, dtype and thread count everywhere (OMP_NUM_THREADS), and the
same step budget (--max-num-batched-tokens). Tool calls under
tool_choice "auto" decode unconstrained on every system (serve.py
--no-constrain-auto), as vLLM's do. Reported per system and concurrency: job
completion per agent (median, p90), per-turn latency (p50, p90), tokens
reused and computed (usage and the server's counters), prefix-cache hit
rate, preemptions (and repeats of one request's), host-tier offload/restore
bytes and seconds, errors. For our systems each turn's timeline as the
server recorded it (GET /v1/sessions/{id}): queued (waiting for admission:
a program's place, a slot, pages), prefill, decode, and the rest of its
latency (steps shared with others, HTTP): printed and plotted.

--repeats N runs every cell N times, the systems in turn within each
repeat (a fresh server each time), and adds a table of medians over the
repeats with each system's job p50 as a multiple of the first system's,
the median of the repeats' own ratios: one run's job time moves by
several seconds on this machine.

    python -m agentkv.experiments.benchmarks.bench_agents [--agents 8,16,32] [--turns-per-agent 4] [--max-tokens 96] \
        [--pause-scale 1] [--kv-fraction 0.3,0.5,1.0] [--systems agentkv,agentkv-noadmit,agentkv-lru,vllm-apc] \
        [--seed 0] [--threads 2] [--workload generated|bfcl] [--model DIR] [--repeats 1]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import httpx

from tqdm import tqdm

from agentkv.engine import STALLS
from agentkv.experiments.common import machine, parse_systems, run_dir
from agentkv.experiments.drivers.servers import ServerProcess, start_engine_server
from agentkv.experiments.drivers.system import ROOT, rel
from agentkv.experiments.drivers.vllm import start_vllm_server, vllm_status
from agentkv.experiments.report import WandbRun, publish, pyplot, save_figure, table
from agentkv.experiments.workloads.agent_runs import (Client, Pauses, Reply, openai_reply, records_json, run_all,
                                                      summarize)
from agentkv.experiments.workloads.agent_workload import KINDS, AgentWorkload
from agentkv.model.config import ModelConfig
from agentkv.model.export import export_hf
from agentkv.model.tokenizer import Tokenizer

SYSTEMS = ("agentkv", "agentkv-noadmit", "agentkv-lru", "vllm-apc")
TIMELINE = ("queued_s", "prefill_s", "decode_s", "other_s")
BLOCK = 128  # vLLM-CPU's KV block size; budgets are whole blocks so that every system gets the same tokens
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Server counters read before and after a run (a run's figures are the
# difference). vLLM's names are exported by both servers.
COUNTERS = {
    "prefix_hits": "vllm:prefix_cache_hits_total",
    "prefix_queries": "vllm:prefix_cache_queries_total",
    "preemptions": "vllm:num_preemptions_total",
    "repeat_preemptions": "agentkv_repeat_preemptions_total",
    "admission_refusals": "agentkv_admission_refusals_total",
    "prompt_tokens_server": "vllm:prompt_tokens_total",
    "vllm_cached_tokens": "vllm:prompt_tokens_cached_total",
    "computed_tokens": "agentkv_computed_tokens_total",
    "cached_tokens": "agentkv_cached_tokens_total",
    "offload_bytes": "agentkv_kv_offload_bytes_total",
    "restore_bytes": "agentkv_kv_restore_bytes_total",
    "offload_s": "agentkv_kv_offload_seconds_total",
    "restore_s": "agentkv_kv_restore_seconds_total",
    "restored_tokens": "agentkv_kv_restored_tokens_total",
    "step_s": "agentkv_step_seconds_total",
    **{f"stalled_{cause}_s": f"agentkv_stalled_{cause}_seconds_total" for cause in STALLS},
}


def model_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))


def hf_checkpoint(model: Path, dtype: str) -> Path:
    """The model as an HF checkpoint directory every server can load: itself,
    or (a GGUF, an adapter over a base) exported once, dequantized and
    merged, before anything is timed."""
    if (model / "config.json").is_file():
        return model
    exported = export_hf(model, ROOT / "runs" / "hf" / f"{model.resolve().name}-{dtype}", dtype)
    print(f"serving {rel(exported)} (exported)")
    return exported


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype]


def start_agentkv(system: str, args: argparse.Namespace, budget: dict, log: Path) -> ServerProcess:
    # bytes / 2**30 is exact in binary floating point: serve.py's int(gb * 2**30) gets the bytes back.
    flags = ["--dtype", args.dtype, "--kv-cache-gb", repr(budget["tokens"] * budget["token_bytes"] / 2**30),
             "--kv-retention", "lru" if system == "agentkv-lru" else "tool",
             "--kv-offload-gb", repr(budget["tier_bytes"] / 2**30),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs),
             "--prefill-chunk", str(args.prefill_chunk), "--no-constrain-auto",
             "--served-model-name", "bench"]
    if system != "agentkv":
        flags.append("--no-program-admission")
    return start_engine_server(args.model, threads=args.threads, extra_args=flags, log=log)


def kv_bytes(system: str, budget: dict) -> int:
    """The KV memory a system gets in all: pool (vLLM: its blocks) plus our host tier."""
    if system == "vllm-apc":
        return budget["tokens"] // BLOCK * BLOCK * budget["token_bytes"]
    return budget["tokens"] * budget["token_bytes"] + budget["tier_bytes"]


def timelines(base_url: str, run_tag: str, agents: list[str]) -> list[dict]:
    """Each turn's record, as our server kept it per session (base_url ends in /v1)."""
    out = []
    for agent in agents:
        r = httpx.get(f"{base_url}/sessions/{run_tag}-{agent}", timeout=30)
        r.raise_for_status()
        for i, t in enumerate(r.json()["turns"]):
            other = t["latency_s"] - t["queued_s"] - t["prefill_s"] - t["decode_s"]
            out.append({"agent": agent, "turn": i, **t, "other_s": max(0.0, other)})
    return out


def needed_tokens(records: list, shared: int) -> int:
    """Prompt tokens no system can avoid computing: each agent's first prompt
    and each later request's new tokens (its prompt less the one before and
    the reply drawn then), less `shared`, what the agents' shared prefixes
    save held once. What a server computes beyond this it computed before
    and lost (recomputation)."""
    needed = 0
    for agent in records:
        prev = None
        for t in agent.turns:
            if t.error:
                break
            needed += t.prompt_tokens - (prev.prompt_tokens + prev.completion_tokens if prev else 0)
            prev = t
    return needed - shared


def timeline_summary(turns: list[dict]) -> dict:
    return {f"{k}_median": statistics.median(t[k] for t in turns) if turns else float("nan") for k in TIMELINE} | {
        f"{k}_total": sum(t[k] for t in turns) for k in TIMELINE}


def start_vllm(args: argparse.Namespace, budget: dict, log: Path) -> ServerProcess:
    blocks = budget["tokens"] // BLOCK
    # The block count is exact; VLLM_CPU_KVCACHE_SPACE (whole GiB, set by
    # vllm_env) only bounds it. vLLM's block pool holds one block back for
    # good (its null block): one more leaves `blocks` usable.
    kv_gb = math.ceil((blocks + 1) * BLOCK * budget["token_bytes"] / 2**30)
    extra = ["--enforce-eager", "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(blocks + 1),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs),
             "--seed", "0"]
    return start_vllm_server(args.model, threads=args.threads, dtype=args.dtype, kv_gb=kv_gb,
                             max_model_len=budget["max_model_len"], served_model_name="bench", extra_args=extra, log=log)


def vllm_kv_line(log: Path) -> str | None:
    """vLLM's own statement of the KV cache it allocated: the last in the log,
    which each budget's server appends to."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if "KV cache size:" in line]
    return lines[-1].split("] ", 1)[-1].strip() if lines else None


def http_client(base_url: str, session_ids: bool, run_tag: str) -> Client:
    """A Client over the openai package: one client per agent, created in the agent's thread."""
    import openai

    clients: dict[str, openai.OpenAI] = {}

    def call(agent: str, messages: list[dict], tools: list[dict], max_tokens: int) -> Reply:
        client = clients.get(agent)
        if client is None:
            client = clients[agent] = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=900)
        extra = {"session_id": f"{run_tag}-{agent}"} if session_ids else None
        return openai_reply(client.chat.completions.create(model="bench", messages=messages, tools=tools,
                                                           max_tokens=max_tokens, temperature=0.0, extra_body=extra))

    return call


def warm_up(base_url: str) -> None:
    """One short request outside the measurement (vLLM's first request is slow)."""
    import openai

    openai.OpenAI(base_url=base_url, api_key="unused").chat.completions.create(
        model="bench", messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0.0)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    return {k: (after[m] - before.get(m, 0.0)) if m in after else None for k, m in COUNTERS.items()}


def run_system(system: str, n_agents: int, work: AgentWorkload, args: argparse.Namespace, budget: dict,
               out: Path) -> dict:
    log = out / f"{system}-{n_agents}.log"
    server = start_vllm(args, budget, log) if system == "vllm-apc" else start_agentkv(system, args, budget, log)
    try:
        warm_up(server.base_url)
        before = server.metrics()
        with tqdm(desc=f"{system} x{n_agents}", unit="request") as bar:
            client = http_client(server.base_url, system != "vllm-apc", f"s{args.seed}")
            records, wall = run_all(work.jobs(client, bar.update))
        counters = delta(before, server.metrics())
        turns = timelines(server.base_url, f"s{args.seed}", work.names) if system != "vllm-apc" else []
    finally:
        server.stop()
    # Prompt tokens the server computed, recomputation after preemption included.
    computed = counters["computed_tokens"]
    if computed is None and counters["vllm_cached_tokens"] is not None:
        computed = counters["prompt_tokens_server"] - counters["vllm_cached_tokens"]
    needed = needed_tokens(records, budget["working_set_tokens"] - budget["distinct_tokens"])
    row = {"system": system, "agents": n_agents, **budget, **summarize(records, wall), **counters,
           "computed_server": computed, "needed_tokens": needed,
           "recomputed_tokens": None if computed is None else max(0, computed - needed), "kv_bytes": kv_bytes(system, budget), "timeline": turns,
           **timeline_summary(turns), "startup_s": server.startup_s, "records": records_json(records)}
    if system == "vllm-apc":
        row["vllm_kv_log"] = vllm_kv_line(log)
    return row


def budget_for(work: AgentWorkload, tokenizer: Tokenizer, args: argparse.Namespace, cfg: ModelConfig,
               fraction: float) -> dict | None:
    """The cell's KV budget; None (said) where it cannot hold the longest request."""
    token_bytes = kv_bytes_per_token(cfg, args.dtype)
    try:
        budget = work.budget(tokenizer, fraction, BLOCK)
    except ValueError as e:
        print(f"skipped: {e}")
        return None
    offload = int(args.offload_gb * 2**30) if args.offload_gb is not None else 0
    return {**budget, "fraction": fraction, "token_bytes": token_bytes, "tier_bytes": offload,
            "max_model_len": min(budget["tokens"], cfg.max_position_embeddings)}


def same_replies(rows: list[dict]) -> None:
    """Per row, how many replies equal the first system's at the same concurrency (greedy, same weights)."""
    first: dict[tuple, dict] = {}
    for row in rows:
        replies = {(t["agent"], i): t["text"] for r in row["records"] for i, t in enumerate(r["turns"])
                   if not t["error"]}
        ref = first.setdefault((row["agents"], row["fraction"]), {"system": row["system"], "replies": replies})
        row["replies_equal_to"] = ref["system"]
        row["replies_equal"] = sum(ref["replies"].get(k) == v for k, v in replies.items())


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


HEADERS = ["system", "agents", "KV tokens / working set (/ distinct)", "KV MB", "turns done", "errors", "end state ok",
           "job s p50", "job s p90", "1st request s p50", "later requests s p50 (per job)", "turn s p50", "turn s p90",
           "prompt tok", "reused (usage)", "computed (server)", "recomputed", "restored", "hit rate",
           "preemptions (repeats)", "admission waits", "offload MB / s", "restore MB / s", "replies = first"]
TIMELINE_HEADERS = ["system", "agents", "KV / working set", "turns", "queued s p50", "prefill s p50", "decode s p50",
                    "other s p50", "queued s all", "prefill s all", "decode s all", "other s all"]


def label(row: dict) -> str:
    """The system, and the repeat after the first."""
    return row["system"] + (f" r{row['repeat']}" if row.get("repeat") else "")


def table_rows(rows: list[dict]) -> list[list]:
    out = []
    for r in rows:
        hit = r["prefix_hits"] / r["prefix_queries"] if r["prefix_queries"] else None
        mb = lambda b: None if b is None else b / 1e6  # noqa: E731
        out.append([
            label(r), r["agents"],
            f"{r['tokens']}/{r['working_set_tokens']} ({r['headroom']:.0%}; {r['tokens'] / r['distinct_tokens']:.0%})",
            f"{r['kv_bytes'] / 1e6:.1f}", f"{r['completed_turns']}/{r['planned_turns']}", len(r["errors"]),
            f"{r['jobs_passed']}/{r['jobs_checked']}" if r["jobs_checked"] else "-", fmt(r["job_s_median"]),
            fmt(r["job_s_p90"]), fmt(r["first_request_s_median"]), fmt(r["later_requests_s_median"]),
            fmt(r["turn_s_p50"], ".2f"), fmt(r["turn_s_p90"], ".2f"), r["prompt_tokens"], r["reused_tokens"],
            fmt(r["computed_server"], ".0f"), fmt(r["recomputed_tokens"], ".0f"), fmt(r["restored_tokens"], ".0f"),
            fmt(hit, ".2f"),
            f"{fmt(r['preemptions'], '.0f')} ({fmt(r['repeat_preemptions'], '.0f')})", fmt(r["admission_refusals"], ".0f"),
            f"{fmt(mb(r['offload_bytes']))} / {fmt(r['offload_s'], '.2f')}",
            f"{fmt(mb(r['restore_bytes']))} / {fmt(r['restore_s'], '.2f')}",
            f"{r['replies_equal']}/{r['requests']}",
        ])
    return out


def timeline_rows(rows: list[dict]) -> list[list]:
    return [[label(r), r["agents"], f"{r['fraction']:.0%}", len(r["timeline"]),
             *(fmt(r[f"{k}_median"], ".2f") for k in TIMELINE), *(fmt(r[f"{k}_total"], ".0f") for k in TIMELINE)]
            for r in rows if r["timeline"]]


def cells(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows by (agents, fraction, system), in run order: one per repeat."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["agents"], r["fraction"], r["system"]), []).append(r)
    return out


def over_repeats(rows: list[dict]) -> list[dict]:
    """Per cell and system: the medians over its repeats, and its job p50 as
    a multiple of the first system's (the median of the per-repeat ratios:
    each repeat ran the systems one after another)."""
    groups = cells(rows)
    first: dict[tuple, str] = {}
    for agents, fraction, system in groups:
        first.setdefault((agents, fraction), system)
    out = []
    for (agents, fraction, system), runs in groups.items():
        ref = {r["repeat"]: r["job_s_median"] for r in groups[agents, fraction, first[agents, fraction]]}
        ratios = [r["job_s_median"] / ref[r["repeat"]] for r in runs if ref.get(r["repeat"])]
        med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
        out.append({"system": system, "agents": agents, "fraction": fraction, "repeats": len(runs),
                    "first": first[agents, fraction], "job_s_median": med("job_s_median"),
                    "job_s_each": [r["job_s_median"] for r in runs], "job_s_p90": med("job_s_p90"),
                    "first_request_s_median": med("first_request_s_median"),
                    "later_requests_s_median": med("later_requests_s_median"),
                    "turn_s_p50": med("turn_s_p50"), "wall_s": med("wall_s"),
                    "errors": sum(len(r["errors"]) for r in runs),
                    "hit_rate": statistics.median(r["prefix_hits"] / r["prefix_queries"] if r["prefix_queries"]
                                                  else float("nan") for r in runs),
                    "ratio_to_first": statistics.median(ratios) if ratios else float("nan")})
    return out


REPEAT_HEADERS = ["system", "agents", "KV / working set", "repeats", "job s p50 (median)", "job s p50 each",
                  "job s p90 (median)", "1st request s p50 (median)", "later requests s p50 (median)",
                  "turn s p50 (median)", "wall s (median)", "errors", "hit rate",
                  "job p50 / first's"]


def repeat_rows(summary: list[dict]) -> list[list]:
    return [[s["system"], s["agents"], f"{s['fraction']:.0%}", s["repeats"], fmt(s["job_s_median"]),
             " ".join(fmt(x) for x in s["job_s_each"]), fmt(s["job_s_p90"]), fmt(s["first_request_s_median"]),
             fmt(s["later_requests_s_median"]), fmt(s["turn_s_p50"], ".2f"),
             fmt(s["wall_s"]), s["errors"], fmt(s["hit_rate"], ".2f"), f"{fmt(s['ratio_to_first'], '.2f')}x"]
            for s in summary]


def plot(res: dict, path: Path) -> None:
    """Per agent count: median job time and prefix-cache hit rate against the KV budget, a line per system
    (medians over repeats)."""
    rows = res["summary"]
    plt = pyplot()
    counts = sorted({r["agents"] for r in rows})
    fig, axes = plt.subplots(2, len(counts), figsize=(5 * len(counts), 7), squeeze=False)
    for col, n in enumerate(counts):
        for system in dict.fromkeys(r["system"] for r in rows):
            pts = sorted((r for r in rows if r["system"] == system and r["agents"] == n), key=lambda r: r["fraction"])
            xs = [r["fraction"] for r in pts]
            axes[0][col].plot(xs, [r["job_s_median"] for r in pts], marker="o", label=system)
            axes[1][col].plot(xs, [r["hit_rate"] for r in pts], marker="o", label=system)
        axes[0][col].set_title(f"{n} agents")
        axes[0][col].set_ylabel("job completion per agent, median (s)")
        axes[1][col].set_ylabel("prefix-cache hit rate")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("KV memory / working set")
            ax.grid(alpha=0.3)
            ax.legend()
    save_figure(fig, path)


def plot_timeline(res: dict, path: Path) -> None:
    """Where our turns' latency went: median seconds queued, in prefill, in decode, and the rest, per cell."""
    rows = [r for r in res["rows"] if r["timeline"]]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    labels = [f"{label(r)}\n{r['agents']}a {r['fraction']:.0%}" for r in rows]
    bottom = [0.0] * len(rows)
    for k in TIMELINE:
        vals = [r[f"{k}_total"] / max(1, len(r["timeline"])) for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=k.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("seconds per turn (mean)")
    ax.legend()
    ax.tick_params(axis="x", labelsize=7)
    save_figure(fig, path)


def run(args: argparse.Namespace) -> dict:
    systems = parse_systems(args.systems, SYSTEMS)
    skipped = {}
    if "vllm-apc" in systems and (why := vllm_status()):
        skipped["vllm-apc"] = why
        systems.remove("vllm-apc")
    out = run_dir("bench_agents", args.out)
    args.model = hf_checkpoint(args.model, args.dtype)
    tokenizer = Tokenizer.from_dir(args.model)
    cfg = model_config(args.model)
    rows = []
    for n in [int(x) for x in str(args.agents).split(",")]:
        work = AgentWorkload(args.workload, n, args.turns_per_agent, args.seed, args.max_tokens,
                             Pauses(args.seed, args.pause_scale), args.max_steps)
        for fraction in [float(x) for x in str(args.kv_fraction).split(",")]:
            budget = budget_for(work, tokenizer, args, cfg, fraction)
            if budget is None:
                continue
            for repeat in range(args.repeats):
                for system in systems:
                    rows.append({**run_system(system, n, work, args, budget, out), "repeat": repeat})
    same_replies(rows)
    return {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "machine": machine(),
            "skipped": skipped, "rows": rows, "summary": over_repeats(rows), "out_dir": str(out)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", default="16", help="concurrent agents, 4 to 32; a comma list runs each (e.g. 4,16)")
    p.add_argument("--turns-per-agent", type=int, default=4, help="user turns per agent")
    p.add_argument("--workload", default="generated", choices=KINDS,
                   help="generated: scripted workflows of one role; bfcl: BFCL v4's multi-turn agents on its classes")
    p.add_argument("--max-steps", type=int, default=4, help="bfcl: replies with calls per user turn before it is cut")
    p.add_argument("--max-tokens", type=int, default=96, help="cap on each reply (greedy)")
    p.add_argument("--pause-scale", type=float, default=1.0, help="multiplies every tool pause (0: none)")
    p.add_argument("--kv-fraction", default="0.5",
                   help="KV memory / the agents' working set; a comma list sweeps (e.g. 0.3,0.5,1.0)")
    p.add_argument("--offload-gb", type=float, default=None,
                   help="a host tier for our servers beside the pool (default none: equal memory, on a CPU the "
                        "tier would be the same RAM); counted in the table's KV bytes")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every server")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="every server's tokens per step")
    p.add_argument("--prefill-chunk", type=int, default=512, help="our servers' prompt chunk")
    p.add_argument("--max-num-seqs", type=int, default=256, help="every server's requests per step")
    p.add_argument("--model", type=Path, default=ROOT / "models" / "agent-8m")
    p.add_argument("--out", default=None, help="run folder (default runs/bench_agents-<time>)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every cell, the systems in turn within each")
    p.add_argument("--no-wandb", action="store_true")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    res = run(args)
    rows = res["rows"]
    lines = [f"{args.turns_per_agent} turns per agent, replies up to {args.max_tokens} tokens, tool pauses "
             f"x{args.pause_scale}, {args.threads} threads per server; distinct = the working set with the agents' "
             f"shared prefix held once; KV MB = each system's KV memory in all:", table(HEADERS, table_rows(rows)),
             "Our turns' timelines (server side: queued for admission, prefill, decode, the rest of the latency):",
             table(TIMELINE_HEADERS, timeline_rows(rows)),
             f"Medians over {args.repeats} repeat(s), the systems in turn within each; job p50 / first's: the median of "
             f"the repeats' ratios to the first system's job p50:", table(REPEAT_HEADERS, repeat_rows(res["summary"]))]
    for r in rows:
        lines.append(f"{label(r)} x{r['agents']}: tool pauses {r['pause_s_min']:.1f} to {r['pause_s_max']:.1f} s, "
                     f"median {r['pause_s_median']:.1f} s, {r['pause_s_total']:.0f} s in all; wall {r['wall_s']:.0f} s")
        if r.get("vllm_kv_log"):
            lines.append(f"vLLM x{r['agents']}: {r['vllm_kv_log']}")
    lines += [f"skipped {s}: {why}" for s, why in res["skipped"].items()]
    summary = {f"{r['system']}/{r['agents']}/{r['fraction']}/r{r['repeat']}/{k}": r[k] for r in rows
               for k in ("job_s_median", "job_s_p90", "turn_s_p50", "turn_s_p90") if not math.isnan(r[k])}
    summary |= {f"{s['system']}/{s['agents']}/{s['fraction']}/{k}": s[k] for s in res["summary"]
                for k in ("job_s_median", "ratio_to_first") if not math.isnan(s[k])}
    wandb = None if args.no_wandb else WandbRun("bench_agents", res["args"], summary,
                                                tables={"systems": (HEADERS, table_rows(rows)),
                                                        "repeats": (REPEAT_HEADERS, repeat_rows(res["summary"]))})
    publish(Path(res["out_dir"]), res, "\n".join(lines),
            plots={"bench_agents.png": plot, "bench_agents_timeline.png": plot_timeline} if rows else {}, wandb=wandb)
    return res


if __name__ == "__main__":
    main()
