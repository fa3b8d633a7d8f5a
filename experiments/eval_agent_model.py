"""Held-out evaluation of an agent model through our Engine.

    python -m experiments.eval_agent_model --model DIR [--turns N] [--out eval.json]

The turns are tool-call turns of workflows no training run draws, every call
to a tool whose name (and many of whose argument names) never occur in
training (the split the model was trained with, from DIR/train_log.json),
each directed by a user message in the explicit or the described style (see
experiments/agent_data.py). Per turn the model answers greedily twice through
Engine.chat on one session: without speculation, then with prompt-lookup
speculation (the second reuses the prompt's KV; which runs first alternates
by turn). Reported:

- valid tool-call JSON: the reply holds at least one <tool_call> block and
  every block parses as {"name": str, "arguments": object};
- right tool: the called names equal the reference's, in order;
- arguments exactly right: right tool and every arguments object equals the
  reference's (the values are copied from the directive and the context);
- values copied: every string value the model wrote occurs in its prompt;
- speculation: accepted draft tokens per verify step, tokens per decode step,
  decode time with and without speculation (same greedy output required).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

from engine import Engine
from experiments import agent_data as D
from experiments.common import machine
from experiments.report import table
from model.tool_calls import parse_tool_calls

TARGETS = {"valid_json": 0.95, "right_tool": 0.80, "exact_args": 0.70}


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    return []


def score(text: str, reference: list[dict], prompt_text: str) -> dict:
    blocks = len(re.findall(r"<tool_call>", text))
    _, calls = parse_tool_calls(text, "hermes")
    valid = blocks > 0 and len(calls) == blocks
    names = [c["name"] for c in calls]
    right_tool = valid and names == [r["name"] for r in reference]
    exact = right_tool and all(c["arguments"] == r["arguments"] for c, r in zip(calls, reference))
    values = [s for c in calls for s in _strings(c["arguments"])]
    copied = valid and all(v in prompt_text or json.dumps(v)[1:-1] in prompt_text for v in values)
    return {"valid_json": valid, "right_tool": right_tool, "exact_args": exact, "values_copied": copied,
            "calls": [{"name": c["name"], "arguments": c["arguments"]} for c in calls]}


def evaluate(model_dir: str, n_turns: int, max_tokens: int, time_limit: float | None, seq_len: int | None,
             progress: bool = True) -> dict:
    start = time.monotonic()
    eng = Engine.from_pretrained(model_dir, device="cpu", dtype="float32")
    log_file = Path(model_dir) / "train_log.json"
    train_log = json.loads(log_file.read_text()) if log_file.is_file() else {}
    split = D.load_split(model_dir)
    seq_len = seq_len or min(train_log.get("seq_len", 8192), eng.max_context)
    renderer = D.Renderer(eng.tokenizer)
    turns = D.eval_turns(n_turns, renderer, seq_len, split, max_reply=max_tokens)
    rows = []
    iterator = turns
    if progress:
        try:
            from tqdm import tqdm

            iterator = tqdm(turns, desc="held-out turns", unit="turn", file=sys.stderr, disable=not sys.stderr.isatty())
        except ImportError:
            pass
    try:
        for k, turn in enumerate(iterator):
            if time_limit is not None and time.monotonic() - start > time_limit:
                break
            rows.append(_turn(eng, renderer, turn, k, max_tokens))
    except KeyboardInterrupt:  # a timeout's SIGINT: report the turns done
        print(f"interrupted after {len(rows)} turns", file=sys.stderr)
    return summarize(rows, model_dir, seq_len, train_log, time.monotonic() - start)


def _turn(eng: Engine, renderer: D.Renderer, turn: D.EvalTurn, k: int, max_tokens: int) -> dict:
    """One turn answered twice on one session (the second reuses the prompt's
    KV): without and with speculation, in alternating order."""
    prompt_text = renderer.render(turn.messages, turn.tools, True)
    runs = {}
    with eng.session() as s:
        for spec in ((False, True) if k % 2 == 0 else (True, False)):
            r = eng.chat(turn.messages, tools=turn.tools, session=s, max_tokens=max_tokens, temperature=0.0,
                         speculative=spec)
            runs[spec] = (r, eng.stats[-1])
    (plain, sp), (spec, ss) = runs[False], runs[True]
    text = eng.tokenizer.decode(spec.token_ids, skip_special_tokens=True)
    return {
        "style": turn.style, "heldout_args": turn.heldout_args, "prompt_tokens": plain.usage["prompt_tokens"],
        "generated": len(spec.token_ids), "identical": plain.token_ids == spec.token_ids,
        "reference": turn.reference, "reply": text,
        "plain": {"decode_s": sp.decode_s, "decode_steps": sp.decode_steps, "generated": sp.generated_tokens},
        "spec": {"decode_s": ss.decode_s, "decode_steps": ss.decode_steps, "generated": ss.generated_tokens,
                 "drafted": ss.drafted_tokens, "accepted": ss.accepted_tokens},
        **score(text, turn.reference, prompt_text),
    }


def _rate(rows: list[dict], key: str) -> float:
    return sum(bool(r[key]) for r in rows) / len(rows) if rows else float("nan")


def summarize(rows: list[dict], model_dir: str, seq_len: int, train_log: dict, wall_s: float) -> dict:
    groups = {"all": rows, "explicit": [r for r in rows if r["style"] == "explicit"],
              "described": [r for r in rows if r["style"] == "described"],
              "held-out args": [r for r in rows if r["heldout_args"] > 0]}
    metrics = {name: {"turns": len(g), **{k: _rate(g, k) for k in ("valid_json", "right_tool", "exact_args",
                                                                      "values_copied")}}
               for name, g in groups.items()}
    steps = sum(r["spec"]["decode_steps"] for r in rows)
    plain_steps = sum(r["plain"]["decode_steps"] for r in rows)
    plain_s = sum(r["plain"]["decode_s"] for r in rows)
    spec_s = sum(r["spec"]["decode_s"] for r in rows)
    decoded = sum(max(0, r["spec"]["generated"] - 1) for r in rows)
    speculation = {
        "identical_outputs": all(r["identical"] for r in rows),
        "accepted_per_verify_step": sum(r["spec"]["accepted"] for r in rows) / steps if steps else float("nan"),
        "draft_acceptance": (sum(r["spec"]["accepted"] for r in rows) / max(1, sum(r["spec"]["drafted"] for r in rows))),
        "tokens_per_step_spec": decoded / steps if steps else float("nan"),
        "tokens_per_step_plain": decoded / plain_steps if plain_steps else float("nan"),
        "decode_s_plain": plain_s, "decode_s_spec": spec_s,
        "decode_speedup": plain_s / spec_s if spec_s else float("nan"),
        "ms_per_token_plain": 1e3 * plain_s / decoded if decoded else float("nan"),
        "ms_per_token_spec": 1e3 * spec_s / decoded if decoded else float("nan"),
    }
    all_ = metrics["all"]
    return {
        "model": str(model_dir), "turns": len(rows), "seq_len": seq_len, "wall_s": wall_s, "metrics": metrics,
        "speculation": speculation, "targets": TARGETS,
        "targets_met": {k: all_[k] >= v for k, v in TARGETS.items()} if rows else {},
        "trained": {k: train_log.get(k) for k in ("shape", "params", "seq_len", "device", "gpu")},
        "machine": machine(), "rows": rows,
    }


def report(res: dict) -> str:
    head = ["turns", "set", "valid JSON %", "right tool %", "exact args %", "values copied %"]
    body = [[m["turns"], name, 100 * m["valid_json"], 100 * m["right_tool"], 100 * m["exact_args"],
             100 * m["values_copied"]] for name, m in res["metrics"].items() if m["turns"]]
    sp = res["speculation"]
    lines = [table(head, body), "",
             f"speculation: {sp['accepted_per_verify_step']:.2f} accepted draft tokens per verify step "
             f"({sp['tokens_per_step_spec']:.2f} tokens/step vs {sp['tokens_per_step_plain']:.2f}), draft acceptance "
             f"{sp['draft_acceptance']:.0%}; decode {sp['ms_per_token_plain']:.1f} -> {sp['ms_per_token_spec']:.1f} "
             f"ms/token, speed-up {sp['decode_speedup']:.2f}x; greedy outputs identical: {sp['identical_outputs']}",
             "targets (issue 10): " + ", ".join(f"{k} >= {v:.0%}: {'met' if res['targets_met'].get(k) else 'MISSED'}"
                                                for k, v in res["targets"].items())]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model folder (e.g. the output of train_agent_model)")
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=256, help="reply budget per turn")
    p.add_argument("--seq-len", type=int, default=None, help="prompt window (default: the model's training length)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--time-limit", type=float, default=None, help="stop starting turns after this many seconds")
    p.add_argument("--out", help="write the JSON here (default DIR/eval.json)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = evaluate(args.model, args.turns, args.max_tokens, args.time_limit, args.seq_len)
    print(report(res))
    out = Path(args.out) if args.out else Path(args.model) / "eval.json"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({**res, "command": " ".join(sys.argv)}, indent=1))
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
