"""The main job: many tool-calling agents at once on one engine, each
pausing while its tools run, with a KV pool that holds only part of their
working set: the regime where keeping an agent's KV across its tool pause
matters. Three ways to serve it, in-process, same model, the same KV
memory in all (on a CPU a host tier would be the same RAM, so none has one),
and with --peers vllm vLLM's own server on the same weights and KV tokens:

- stateful: a session per agent, retention="tool" (a session whose turn
  ended on a tool call keeps its KV pinned for the pause its tool usually
  takes; idle KV gives way before running work) and program admission
  (agents admitted whole while their KV fits);
- stateless: every turn re-prefills the whole history (not run unless
  --systems names it: slow);
- block-hash: a fresh session per request, prefix reuse in whole pages,
  plain LRU, no host tier, as vLLM's automatic prefix caching serves it.

The agents (--workload bfcl, the default) are BFCL v4's multi-turn
conversations run live (experiments/workloads/bfcl_agents.py): every tool
call runs on BFCL's own classes (GorillaFileSystem, TradingBot, ...), the
results go back to the model, each agent's end state is checked against
BFCL's ground truth, and a seeded log-normal pause per tool class stands
for remote tools. --workload generated: the generated workflows of
experiments/workloads/agent_runs.py (scripted tool results, pauses per
tool name). Each agent is a thread calling Engine.start_chat while the
scheduler loop batches them all. Writes results.json, report.txt, a
timeline PNG (each agent's requests, queue waits and tool pauses per
system) and an offline wandb run under --out.

With --shape 6|35|interleaved: the earlier teacher-forced replay of one
workflow turn by turn, stateful vs stateless, a row per turn.

    python serve.py demo [--agents 8] [--turns-per-agent 2] [--pause-scale 1] [--kv-fraction 0.3] [--out DIR]
    python serve.py demo --full [--peers vllm]   # 8/16/32 agents x KV 30/50/100%, vLLM's server beside
    python serve.py demo --workload generated [--agents 6] [--turns-per-agent 3]
    python serve.py demo --shape 6|35|interleaved [--seed 0] [--model PATH]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from agentkv import Engine
from agentkv.experiments.benchmarks.bench_agents import (BLOCK, delta, hf_checkpoint, http_client, model_config,
                                                          start_vllm, warm_up)
from agentkv.experiments.common import median, parse_systems, run_dir
from agentkv.experiments.drivers.vllm import vllm_status
from agentkv.experiments.drivers.replay import prepare_requests, workflow
from agentkv.experiments.report import WandbRun, publish, table, write_json
from agentkv.experiments.timeline import plot_timelines
from agentkv.experiments.workloads.agent_runs import Client, Pauses, Reply, records_json, run_all, summarize
from agentkv.experiments.workloads.agent_workload import KINDS, AgentWorkload
from agentkv.experiments.workloads.workflows import Workflow, interleaved_run
from agentkv.kernels.cpu_extension import isa
from agentkv.kernels.dispatch import build_cpu_kernels
from agentkv.model.default import default_model_dir

SYSTEMS = ("stateful", "stateless", "block-hash")
PEERS = ("vllm",)
# --full: the whole sweep (agents x the pool over their working set).
FULL_AGENTS, FULL_FRACTIONS = (8, 16, 32), (0.3, 0.5, 1.0)
# Stateless re-prefills every prompt: on BFCL's agents (4k-token function docs)
# it takes six minutes of a 2-core CPU where the others take one; ask for it.
DEFAULT_SYSTEMS = ("stateful", "block-hash")


def engine_client(engine: Engine, agents: list[str] | None) -> Client:
    """Chat turns on `engine`; with agents, each one's turns go to its own session."""
    sessions = {a: engine.session() for a in agents or ()}

    def call(agent: str, messages: list[dict], tools: list[dict], max_tokens: int) -> Reply:
        r = engine.start_chat(messages, tools, session=sessions.get(agent), max_tokens=max_tokens,
                              temperature=0.0).wait()
        return Reply(r.text, r.tool_calls, r.usage["prompt_tokens"], r.usage["cached_tokens"], r.finish_reason,
                     r.usage["completion_tokens"], r.stats.queued_s if r.stats is not None else 0.0)

    return call


def system_engine(system: str, base: Engine, kv_bytes: int) -> Engine:
    kwargs = {
        "stateful": {"retention": "tool"},
        "stateless": {"stateless": True},
        "block-hash": {"prefix_match": "block", "retention": "lru", "program_admission": False},
    }[system]
    return Engine(base.model, base.tokenizer, kv_cache_bytes=kv_bytes, kv_offload_bytes=0, **kwargs)


def agents_run(args: argparse.Namespace, base: Engine, n_agents: int, fraction: float, out: Path) -> dict:
    """One cell: n_agents at a KV pool of `fraction` of their working set, each system in turn."""
    token_bytes = base.pool.token_bytes
    vllm = "vllm" in args.peers
    try:
        work = AgentWorkload(args.workload, n_agents, args.turns_per_agent, args.seed, args.max_tokens,
                             Pauses(args.seed, args.pause_scale), args.max_steps,
                             tuple(args.roles.split(",")) if args.roles else None)
        # With vLLM beside, budgets are whole vLLM blocks so that it gets the same KV tokens.
        budget = work.budget(base.tokenizer, fraction, BLOCK if vllm else base.pool.page_size)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    rows, records = [], {}
    for system in parse_systems(args.systems, SYSTEMS):
        engine = system_engine(system, base, budget["tokens"] * token_bytes)
        client = engine_client(engine, work.names if system == "stateful" else None)
        engine.scheduler.start()
        try:
            with tqdm(desc=system, unit="request") as bar:
                recs, wall = run_all(work.jobs(client, bar.update))
        finally:
            engine.scheduler.stop()
        totals = engine.scheduler.turn_totals
        kv_bytes = engine.pool.num_pages * engine.pool.page_size * token_bytes
        records[system] = records_json(recs)
        rows.append({"system": system, **summarize(recs, wall), "kv_bytes": kv_bytes, "host_tier_bytes": 0,
                     "computed_tokens": int(totals.get("computed_tokens", 0)),
                     "restored_tokens": int(totals.get("restored_tokens", 0)),
                     "preemptions": engine.scheduler.counters.preemptions})
    if vllm:
        row, recs = vllm_run(args, work, budget, token_bytes, out / f"vllm-{n_agents}-{fraction:g}.log")
        rows.append(row)
        records["vllm"] = recs
    return {"workload": args.workload, "what": work.what, "agents": n_agents, "fraction": fraction, **budget,
            "pause_scale": args.pause_scale, "config": {k: v for k, v in vars(args).items() if k != "out"},
            "rows": rows, "records": records}


def vllm_run(args: argparse.Namespace, work: AgentWorkload, budget: dict, token_bytes: int,
             log: Path) -> tuple[dict, list[dict]]:
    """vLLM's own OpenAI server (prefix caching on) on the same weights,
    exported once to an HF checkpoint, with the same KV tokens, over HTTP."""
    model = hf_checkpoint(Path(args.model) if args.model else default_model_dir(), args.dtype)
    server_args = argparse.Namespace(model=model, threads=args.threads, dtype=args.dtype,
                                     max_num_batched_tokens=args.max_num_batched_tokens)
    cfg = model_config(model)
    server = start_vllm(server_args, {**budget, "token_bytes": token_bytes,
                                      "max_model_len": min(budget["tokens"], cfg.max_position_embeddings)}, log)
    try:
        warm_up(server.base_url)
        before = server.metrics()
        with tqdm(desc="vllm", unit="request") as bar:
            recs, wall = run_all(work.jobs(http_client(server.base_url, False, "demo"), bar.update))
        counters = delta(before, server.metrics())
    finally:
        server.stop()
    summary = summarize(recs, wall)
    cached = counters["vllm_cached_tokens"]
    return ({"system": "vllm", **summary, "kv_bytes": budget["tokens"] // BLOCK * BLOCK * token_bytes,
             "host_tier_bytes": 0,
             "computed_tokens": int(counters["prompt_tokens_server"] - cached) if cached is not None else None,
             "restored_tokens": 0, "preemptions": int(counters["preemptions"] or 0)}, records_json(recs))


def agents_report(res: dict) -> str:
    args = res["config"]
    pauses = res["rows"][0]["pause_s_total"]
    head = (f"{res['agents']} agents at once: {res['what']}; replies up to {args['max_tokens']} tokens, greedy.\n"
            f"Memory: every system gets the same KV pool, {res['tokens']} tokens = {res['headroom']:.0%} of the agents' "
            f"working set ({res['working_set_tokens']} tokens; {res['distinct_tokens']} with shared prefixes held "
            f"once), and no host tier beside it (on a CPU a tier is the same RAM as the pool).\n"
            f"Tool pauses: seeded log-normals per tool, 0.2-20 s x{res['pause_scale']} "
            f"({pauses:.0f} s in all in the first system's run).")
    if any(r["system"] == "vllm" for r in res["rows"]):
        head += ("\nvllm: vLLM's own OpenAI server (prefix caching on) on the same weights exported to an HF "
                 "checkpoint, the same KV tokens (whole blocks of 128), over HTTP; the others run in-process.")
    checked = res["rows"][0]["jobs_checked"]
    body = [[r["system"], f"{r['kv_bytes'] / 1e6:.1f}", f"{r['completed_turns']}/{r['planned_turns']}", r["requests"],
             len(r["errors"]), f"{r['jobs_passed']}/{checked}" if checked else "-", r["job_s_median"], r["job_s_p90"],
             f"{r['turn_s_p50']:.2f}", f"{r['turn_s_p90']:.2f}", f"{r['queued_s_total']:.1f}", r["computed_tokens"],
             r["prompt_tokens"], r["reused_tokens"], r["preemptions"], r["wall_s"]] for r in res["rows"]]
    return head + "\n" + table(
        ["system", "KV MB", "turns", "requests", "errors", "end state ok", "job s p50", "job s p90", "request s p50",
         "request s p90", "queued s", "computed tok", "prompt tok", "reused tok", "preemptions", "wall s"], body)


# ---------------------------------------------------------------------------
# Teacher-forced replay of one workflow (--shape 6|35|interleaved)


def replay_workflow(shape: str, seed: int) -> Workflow:
    return interleaved_run(seed, n_agents=4, turns_per_agent=3) if shape == "interleaved" else workflow(shape, seed)


def replay(args: argparse.Namespace) -> list[dict]:
    """Each turn sends the agent's history with the reference assistant
    messages, as an agent framework re-sends it, and generates as many
    tokens as the reference reply has, so both modes do the same work."""
    stateful = Engine.from_pretrained(args.model, dtype=args.dtype)
    stateless = Engine(stateful.model, stateful.tokenizer, stateless=True)
    reqs = prepare_requests(stateful.tokenizer, replay_workflow(args.shape, args.seed), None, None)
    sessions = {}
    rows = []
    for r in tqdm(reqs, desc="turns", unit="turn"):
        session = sessions.setdefault(r.agent, stateful.session())
        a = stateful.chat(r.messages, tools=r.tools, session=session, max_tokens=r.gen, ignore_eos=True)
        sa = stateful.stats[-1]
        stateless.chat(r.messages, tools=r.tools, max_tokens=r.gen, ignore_eos=True)
        sb = stateless.stats[-1]
        rows.append({
            "agent": r.agent, "prompt": a.usage["prompt_tokens"], "reused": a.usage["cached_tokens"],
            "computed": sa.computed_tokens, "generated": sa.generated_tokens,
            "stateful_ms": sa.total_s * 1e3, "stateless_ms": sb.total_s * 1e3,
        })
    for s in sessions.values():
        s.close()
    return rows


def print_replay(rows: list[dict]) -> None:
    body = [
        [i + 1, r["agent"], r["prompt"], r["reused"], r["computed"], r["generated"], r["stateful_ms"], r["stateless_ms"],
         f"{r['stateless_ms'] / r['stateful_ms']:.2f}x"]
        for i, r in enumerate(rows)
    ]
    print(table(["turn", "agent", "prompt", "reused", "computed", "generated", "stateful ms", "stateless ms", "speed-up"], body))
    speedups = [r["stateless_ms"] / r["stateful_ms"] for r in rows]
    total_a = sum(r["stateful_ms"] for r in rows) / 1e3
    total_b = sum(r["stateless_ms"] for r in rows) / 1e3
    print(f"median turn speed-up {median(speedups):.2f}x; end to end {total_a:.2f} s stateful vs {total_b:.2f} s "
          f"stateless ({total_b / total_a:.2f}x); tokens computed {sum(r['computed'] for r in rows)} vs "
          f"{sum(r['prompt'] for r in rows)}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="serve.py demo", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="agents", choices=["agents", "6", "35", "interleaved"],
                   help="agents: many agents at once with tool pauses; 6|35|interleaved: teacher-forced replay")
    p.add_argument("--workload", default="bfcl", choices=KINDS,
                   help="bfcl: BFCL v4's multi-turn agents on its tool classes; generated: scripted workflows")
    p.add_argument("--agents", type=int, default=8, help="agents at once")
    p.add_argument("--turns-per-agent", type=int, default=2, help="user turns per agent")
    p.add_argument("--roles", default=None,
                   help="bfcl: the agents' BFCL classes, comma-separated, agents spread over them in turn "
                        "(a role of several classes joins them with +; default GorillaFileSystem,TradingBot)")
    p.add_argument("--max-steps", type=int, default=4, help="bfcl: replies with calls per user turn before it is cut")
    p.add_argument("--max-tokens", type=int, default=128, help="cap on each reply (greedy)")
    p.add_argument("--pause-scale", type=float, default=1.0, help="multiplies every tool pause (0: none)")
    p.add_argument("--kv-fraction", type=float, default=0.3,
                   help="KV pool / the agents' working set (their shared prefixes held once is about a third of it)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma list of {', '.join(SYSTEMS)} (stateless re-prefills every prompt: slow)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--dtype", default="float32",
                   help="float32, bfloat16, or auto (the checkpoint's own where the CPU computes in it)")
    p.add_argument("--full", action="store_true",
                   help=f"the whole sweep: {'/'.join(map(str, FULL_AGENTS))} agents x a pool of "
                        f"{'/'.join(f'{f:.0%}' for f in FULL_FRACTIONS)} of their working set (an hour or more)")
    p.add_argument("--peers", default="", help="vllm: vLLM's own server beside, on the same weights and KV tokens, "
                                              "when its venv exists (bash experiments/drivers/peers/setup_vllm.sh)")
    p.add_argument("--threads", type=int, default=2, help="a peer server's OMP_NUM_THREADS")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="a peer server's tokens per step")
    p.add_argument("--out", default=None, help="the run's folder (default runs/demo-<time>)")
    args = p.parse_args(argv)
    args.peers = parse_systems(args.peers, PEERS) if args.peers else []
    out = run_dir("demo", args.out)
    started = time.perf_counter()
    failed = build_cpu_kernels()  # before any clock starts: a first-use compile is no system's time
    print(f"C++ CPU kernels for {isa()} ready in {time.perf_counter() - started:.1f} s"
          + "".join(f"; {k} did not build ({e}), its torch path runs" for k, e in failed.items()))
    if args.shape != "agents":
        rows = replay(args)
        print_replay(rows)
        write_json(out / "results.json", {"shape": args.shape, "rows": rows})
        return {"shape": args.shape, "rows": rows}
    if "vllm" in args.peers and (why := vllm_status()):
        print(f"vLLM skipped: {why}")
        args.peers = [p for p in args.peers if p != "vllm"]
    base = Engine.from_pretrained(args.model, dtype=args.dtype, num_pages=1)  # the model and tokenizer; each system gets its own pool
    cells = [(n, f) for n in FULL_AGENTS for f in FULL_FRACTIONS] if args.full else [(args.agents, args.kv_fraction)]
    runs = [agents_run(args, base, n, f, out) for n, f in cells]
    res = runs[0] if len(runs) == 1 else {"config": runs[0]["config"], "cells": runs}
    summary = {f"{c['agents']}/{c['fraction']:g}/{r['system']}/{k}": r[k] for c in runs for r in c["rows"]
               for k in ("job_s_median", "job_s_p90", "turn_s_p90", "computed_tokens", "jobs_passed")}
    plots = {(f"timeline-{c['agents']}-{c['fraction']:g}.png" if args.full else "timeline.png"):
             (lambda _, path, c=c: plot_timelines(c["records"], path)) for c in runs}
    columns = ["agents", "kv_fraction", *runs[0]["rows"][0]]
    rows = [[c["agents"], c["fraction"], *(json.dumps(v) if isinstance(v, list) else v for v in r.values())]
            for c in runs for r in c["rows"]]
    publish(out, res, "\n\n".join(agents_report(c) for c in runs), plots=plots,
            wandb=WandbRun("demo", runs[0]["config"], summary, tables={"systems": (columns, rows)}))
    return res

if __name__ == "__main__":
    main()
