"""The main job: a multi-agent tool-calling workflow served by the engine,
stateful (each agent's session keeps its KV across turns) side by side with
the same engine stateless (every turn re-prefills the whole history).

Replay is teacher-forced: each turn sends the agent's history with the
reference assistant messages, as an agent framework re-sends it, and generates
as many tokens as the reference reply has, so both modes do the same work.

    python serve.py demo [--shape 6|35|interleaved] [--seed 0] [--model PATH]
"""
from __future__ import annotations

import argparse
import json

from tqdm import tqdm

from engine import Engine
from experiments.common import median, table
from experiments.workloads import interleaved_run, six_turn_workflow, thirty_five_turn_workflow


def reply_tokens(engine: Engine, reply: dict) -> int:
    """Tokens the reference assistant message takes in the model's template."""
    text = reply.get("content") or ""
    for call in reply.get("tool_calls") or []:
        fn = call["function"]
        text += f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {fn["arguments"]}}}\n</tool_call>'
    return max(1, len(engine.tokenizer.encode(text)))


def workflow(shape: str, seed: int):
    if shape == "6":
        return six_turn_workflow(seed)
    if shape == "35":
        return thirty_five_turn_workflow(seed)
    return interleaved_run(seed, n_agents=4, turns_per_agent=3)


def run(args: argparse.Namespace) -> list[dict]:
    stateful = Engine.from_pretrained(args.model)
    stateless = Engine(stateful.model, stateful.tokenizer, stateless=True)
    wf = workflow(args.shape, args.seed)
    sessions = {}
    rows = []
    turns = list(wf.turns())
    for turn in tqdm(turns, desc="turns", unit="turn"):
        n_gen = reply_tokens(stateful, turn.reply)
        session = sessions.setdefault(turn.agent, stateful.session())
        a = stateful.chat(turn.request, tools=turn.tools, session=session, max_tokens=n_gen, ignore_eos=True)
        sa = stateful.stats[-1]
        stateless.chat(turn.request, tools=turn.tools, max_tokens=n_gen, ignore_eos=True)
        sb = stateless.stats[-1]
        rows.append({
            "agent": turn.agent, "prompt": a.usage["prompt_tokens"], "reused": a.usage["cached_tokens"],
            "computed": sa.computed_tokens, "generated": sa.generated_tokens,
            "stateful_ms": sa.total_s * 1e3, "stateless_ms": sb.total_s * 1e3,
        })
    for s in sessions.values():
        s.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="serve.py demo", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="6", choices=["6", "35", "interleaved"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    rows = run(args)
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
