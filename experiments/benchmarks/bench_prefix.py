"""Prefix sharing across agents: eight agents with one system prompt and tool
schemas, their turns interleaved, served with the radix cache at token
granularity vs whole-block matching (what block-hash caches and page-aligned
radix trees reuse) vs no cross-session cache. Every agent keeps its own
persistent session in all three modes.

Reports tokens computed against the ideal (the shared prefix once plus each
agent's own deltas), pages held by the live sessions against the ideal, the
prefix-cache counters and wall time.

    python -m agentkv.experiments.benchmarks.bench_prefix [--agents 8] [--turns 10] [--gen 16]
"""
from __future__ import annotations

import argparse
import time

from tqdm import tqdm

from agentkv import Engine
from agentkv.cache.tokens import common_prefix_len
from agentkv.experiments.common import machine, run_dir
from agentkv.experiments.report import table, write_json
from agentkv.experiments.workloads.workflows import interleaved_run

MODES = {
    "radix (token)": dict(prefix_cache=True, prefix_match="token"),
    "radix (block)": dict(prefix_cache=True, prefix_match="block"),
    "no prefix cache": dict(prefix_cache=False),
}


def run_mode(base: Engine, kwargs: dict, workflow, gen: int, pages: int) -> dict:
    engine = Engine(base.model, base.tokenizer, page_size=base.pool.page_size, num_pages=pages, **kwargs)
    sessions: dict[str, object] = {}
    first_prompts: dict[str, list[int]] = {}
    computed = ideal = 0
    peak_live = 0
    start = time.perf_counter()
    ended: set[str] = set()  # agents whose history outgrew the model's context
    for turn in tqdm(list(workflow.turns()), desc=next(k for k, v in MODES.items() if v == kwargs), leave=False):
        prompt = engine.tokenizer.apply_chat_template(turn.request, tools=turn.tools)
        if turn.agent in ended or len(prompt) + gen > engine.max_context:
            ended.add(turn.agent)
            continue
        s = sessions.setdefault(turn.agent, engine.session())
        if turn.agent not in first_prompts:
            # Ideal: what no other agent has already computed.
            seen = max((common_prefix_len(prompt, p) for p in first_prompts.values()), default=0)
            ideal += len(prompt) - seen
            first_prompts[turn.agent] = prompt
        else:
            ideal += len(prompt) - common_prefix_len(prompt, s.tokens)
        engine.chat(turn.request, tools=turn.tools, session=s, max_tokens=gen, ignore_eos=True, speculative=False)
        computed += engine.stats[-1].computed_tokens
        live = {p for x in sessions.values() for p in x.table.pages}
        peak_live = max(peak_live, len(live))
    elapsed = time.perf_counter() - start
    ps = engine.pool.page_size
    common = min(common_prefix_len(p, q) for p in first_prompts.values() for q in first_prompts.values() if p is not q)
    ideal_pages = -(-common // ps) + sum(-(-(len(s.table.pages) * ps - common) // ps) for s in sessions.values())
    live_pages = len({p for x in sessions.values() for p in x.table.pages})
    result = {
        "computed_tokens": computed,
        "ideal_computed_tokens": ideal,
        "live_pages": live_pages,
        "peak_live_pages": peak_live,
        "ideal_live_pages": ideal_pages,
        "pool_pages_used": engine.pool.num_used,
        "seconds": elapsed,
        "shared_prefix_tokens": common,
        "agents_ended_at_context": sorted(ended),
        "cache": engine.cache_stats(),
    }
    for s in sessions.values():
        s.close()
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--gen", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--pages", type=int, default=16384)
    args = p.parse_args(argv)
    base = Engine.from_pretrained(args.model, num_pages=16)
    wf = interleaved_run(args.seed, n_agents=args.agents, turns_per_agent=args.turns)
    results = {name: run_mode(base, kw, wf, args.gen, args.pages) for name, kw in MODES.items()}
    rows = [
        [name, r["computed_tokens"], r["ideal_computed_tokens"], f"{r['computed_tokens'] / r['ideal_computed_tokens']:.3f}",
         r["live_pages"], r["ideal_live_pages"], r["pool_pages_used"], r["seconds"]]
        for name, r in results.items()
    ]
    print(table(["mode", "computed", "ideal", "ratio", "live pages", "ideal pages", "pool used", "seconds"], rows))
    shared = next(iter(results.values()))["shared_prefix_tokens"]
    ended = next(iter(results.values()))["agents_ended_at_context"]
    print(f"{args.agents} agents x {args.turns} turns; shared prefix {shared} tokens; page size {base.pool.page_size}; "
          f"agents stopped early at the model's context: {', '.join(ended) or 'none'}")
    out = run_dir("bench_prefix")
    write_json(out / "results.json", {"args": vars(args), "machine": machine(), "results": results})
    print(f"wrote {out}/results.json")


if __name__ == "__main__":
    main()
