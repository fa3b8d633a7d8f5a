"""The main job: many tool-calling agents at once on one engine, each
pausing while its tools run, with a KV pool that holds only part of their
working set: the regime where keeping an agent's KV across its tool pause
matters. Three ways to serve it, in-process, same model, the same KV
memory in all (on a CPU a host tier would be the same RAM, so none has one):

- stateful: a session per agent, retention="tool" (a session whose turn
  ended on a tool call keeps its KV pinned for the pause its tool usually
  takes; idle KV gives way before running work) and program admission
  (agents admitted whole while their KV fits);
- stateless: every turn re-prefills the whole history;
- block-hash: a fresh session per request, prefix reuse in whole pages,
  plain LRU, no host tier, as vLLM's automatic prefix caching serves it.

The agents run live (experiments/workloads/agent_runs.py): their histories hold the
model's own replies, tool results are the workload's, pauses are seeded
log-normals per tool name. Each agent is a thread calling Engine.start_chat
while the scheduler loop batches them all.

With --shape 6|35|interleaved: the earlier teacher-forced replay of one
workflow turn by turn, stateful vs stateless, a row per turn.

    python serve.py demo [--agents 6] [--turns-per-agent 3] [--pause-scale 1] [--kv-fraction 0.3]
    python serve.py demo --shape 6|35|interleaved [--seed 0] [--model PATH]
"""
from __future__ import annotations

import argparse
import json
import time

from tqdm import tqdm

from agentkv import Engine
from agentkv.experiments.common import median, parse_systems
from agentkv.experiments.drivers.replay import prepare_requests, workflow
from agentkv.experiments.report import table
from agentkv.experiments.workloads.agent_runs import Client, Pauses, Reply, kv_budget, plan, run_agents, summarize
from agentkv.experiments.workloads.workflows import Workflow, interleaved_run
from agentkv.kernels.cpu_extension import isa
from agentkv.kernels.dispatch import build_cpu_kernels

SYSTEMS = ("stateful", "stateless", "block-hash")


def engine_client(engine: Engine, agents: list[str] | None) -> Client:
    """Chat turns on `engine`; with agents, each one's turns go to its own session."""
    sessions = {a: engine.session() for a in agents or ()}

    def call(agent: str, messages: list[dict], tools: list[dict], max_tokens: int) -> Reply:
        r = engine.start_chat(messages, tools, session=sessions.get(agent), max_tokens=max_tokens,
                              temperature=0.0).wait()
        return Reply(r.text, r.tool_calls, r.usage["prompt_tokens"], r.usage["cached_tokens"], r.finish_reason)

    return call


def system_engine(system: str, base: Engine, kv_bytes: int) -> Engine:
    kwargs = {
        "stateful": {"retention": "tool"},
        "stateless": {"stateless": True},
        "block-hash": {"prefix_match": "block", "retention": "lru", "program_admission": False},
    }[system]
    return Engine(base.model, base.tokenizer, kv_cache_bytes=kv_bytes, kv_offload_bytes=0, **kwargs)


def agents_run(args: argparse.Namespace) -> dict:
    base = Engine.from_pretrained(args.model, dtype=args.dtype, num_pages=1)  # the model and tokenizer; each system gets its own pool
    wf = plan(args.seed, args.agents, args.turns_per_agent)
    token_bytes = base.pool.token_bytes
    try:
        budget = kv_budget(base.tokenizer, wf, args.max_tokens, args.kv_fraction, base.pool.page_size)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    pauses = Pauses(args.seed, args.pause_scale)
    rows = []
    for system in parse_systems(args.systems, SYSTEMS):
        engine = system_engine(system, base, budget["tokens"] * token_bytes)
        client = engine_client(engine, [c.agent for c in wf.conversations] if system == "stateful" else None)
        engine.scheduler.start()
        try:
            with tqdm(total=sum(len(c.copied) for c in wf.conversations), desc=system, unit="turn") as bar:
                records, wall = run_agents(wf, client, args.max_tokens, pauses, on_turn=bar.update)
        finally:
            engine.scheduler.stop()
        totals = engine.scheduler.turn_totals
        kv_bytes = engine.pool.num_pages * engine.pool.page_size * token_bytes
        rows.append({"system": system, **summarize(records, wall), "kv_bytes": kv_bytes,
                     "computed_tokens": int(totals.get("computed_tokens", 0)),
                     "restored_tokens": int(totals.get("restored_tokens", 0)),
                     "preemptions": engine.scheduler.counters.preemptions})
    return {"agents": args.agents, **budget, "pause_scale": args.pause_scale, "rows": rows}


def print_agents(res: dict, args: argparse.Namespace) -> None:
    pauses = res["rows"][0]["pause_s_total"]
    print(f"\n{res['agents']} agents at once, {args.turns_per_agent} turns each, replies up to {args.max_tokens} tokens; "
          f"KV pool {res['tokens']} tokens = {res['headroom']:.0%} of their working set ({res['working_set_tokens']}; "
          f"{res['distinct_tokens']} with their shared prefix once); tool pauses 0.2-20 s x{args.pause_scale} "
          f"({pauses:.0f} s in all)")
    body = [[r["system"], f"{r['kv_bytes'] / 1e6:.1f}", f"{r['completed_turns']}/{r['planned_turns']}", len(r["errors"]),
             r["job_s_median"],
             r["job_s_p90"], f"{r['turn_s_p50']:.2f}", f"{r['turn_s_p90']:.2f}", r["computed_tokens"], r["prompt_tokens"],
             r["reused_tokens"], r["restored_tokens"], r["preemptions"], r["wall_s"]] for r in res["rows"]]
    print(table(["system", "KV MB in all", "turns", "errors", "job s p50", "job s p90", "turn s p50", "turn s p90", "computed tok",
                 "prompt tok", "reused tok", "of which restored", "preemptions", "wall s"], body))


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


def main(argv: list[str] | None = None) -> dict | list[dict]:
    p = argparse.ArgumentParser(prog="serve.py demo", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="agents", choices=["agents", "6", "35", "interleaved"],
                   help="agents: many agents at once with tool pauses; 6|35|interleaved: teacher-forced replay")
    p.add_argument("--agents", type=int, default=6, help="agents at once")
    p.add_argument("--turns-per-agent", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96, help="cap on each reply (greedy; 96 holds a whole tool call)")
    p.add_argument("--pause-scale", type=float, default=1.0, help="multiplies every tool pause (0: none)")
    p.add_argument("--kv-fraction", type=float, default=0.3,
                   help="KV pool / the agents' working set (0.3: about half of it with the shared prefix held once)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--dtype", default="float32",
                   help="float32, bfloat16, or auto (the checkpoint's own where the CPU computes in it)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    started = time.perf_counter()
    failed = build_cpu_kernels()  # before any clock starts: a first-use compile is no system's time
    print(f"C++ CPU kernels for {isa()} ready in {time.perf_counter() - started:.1f} s"
          + "".join(f"; {k} did not build ({e}), its torch path runs" for k, e in failed.items()))
    if args.shape == "agents":
        res = agents_run(args)
        print_agents(res, args)
    else:
        res = replay(args)
        print_replay(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
