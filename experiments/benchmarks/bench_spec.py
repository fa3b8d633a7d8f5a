"""What each draft source buys on the trained agent model's tool-call turns,
live: the model writes every reply itself, greedy, and each drafter sees the
replies the namespace's agents wrote before.

    python -m agentkv.experiments.benchmarks.bench_spec [--model models/agent-8m] [--turns 24] [--threads 1]

The turns are held-out tool-call turns of multi-agent workflows
(experiments.default_model.data.eval_turns: held-out tools, two agents' turns per
workflow, in workflow order), answered under tool_choice "auto" (a call the
model opens is held to the tools' schemas), each mode on its own engine
over the same weights, one KV namespace per engine:

- none: no speculation (one token per decode forward);
- ngram: prompt lookup over the session (spec.ngram);
- ngram+forced: that, after what the grammar forces next (main before suffix trees);
- suffix: suffix trees over the session and the namespace's finished replies (spec.suffix);
- suffix+forced: that, after what the grammar forces next (the engine's default);
- all: that, and the called tool's schema names where the drafter has
  nothing the grammar allows (spec.schema_phrases).

A turn's prompt is computed untimed, with its drafter's index (a live
session keeps it across turns); the reply is timed, modes side by side per
turn. Reported per mode: accepted draft tokens per verify step, tokens per
decode forward (drafts accepted + the drawn token; the first token comes
from the prompt's forward), decode speed-up over none (median of per-turn
ratios, and total time over total time), greedy identity with none,
acceptance by span kind (what share of each kind's tokens came from
accepted drafts: JSON syntax, tool name, argument name, argument value,
free text) and the share of repeated tokens (a token equal to the one
before it: degenerate output would inflate every drafter). Then the cost
of verifying k + 1 tokens against a decode step, on a held context, and a
draft-only replay of the plain replies through drafter variants (the
suffix drafter's settings against SuffixDecoding's).
Writes a table, runs/bench_spec-*/results.json, plot.png and an offline wandb run.
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from agentkv import Engine
from agentkv.engine.step_observer import StepObserver
from agentkv.engine.structured import request_grammar
from agentkv.experiments.common import machine, median, run_dir
from agentkv.experiments.default_model import data as D
from agentkv.experiments.report import WandbRun, publish, pyplot, save_figure, table
from agentkv.spec.ngram import NGramDrafter
from agentkv.spec.suffix import OutputTree, SuffixDrafter

# mode -> (drafter, grammar-forced drafts, schema drafts); None: no speculation.
MODES = {
    "none": None,
    "ngram": ("ngram", False, False),
    "ngram+forced": ("ngram", True, False),
    "suffix": ("suffix", False, False),
    "suffix+forced": ("suffix", True, False),
    "all": ("suffix", True, True),
}
KINDS = ("syntax", "tool_name", "arg_name", "arg_value", "text")
# Draft-only replays of the plain replies: drafter settings, given the namespace's output tree.
REPLAYS = {
    "ngram": lambda outputs: NGramDrafter(),
    "suffix, SuffixDecoding's walk and defaults (most frequent child, draft <= match, p >= 0.1, 8 tokens)":
        lambda outputs: SuffixDrafter(outputs, max_factor=1.0, min_prob=0.1, max_k=8, newest=False),
    "suffix, most frequent child": lambda outputs: SuffixDrafter(outputs, newest=False),
    "suffix (default: newest child, draft <= 2 x match, p >= 0.2, 16 tokens)": lambda outputs: SuffixDrafter(outputs),
    "suffix, without the namespace's outputs": lambda outputs: SuffixDrafter(None),
}
VERIFY_KS = (0, 1, 2, 4, 8, 16)


def char_kinds(text: str) -> list[str]:
    """The span kind of each character of a reply: inside <tool_call> ...
    </tool_call>, the tool name's and argument names' string contents, the
    argument values (strings' contents, numbers, literals, nested values) and
    JSON syntax (quotes, braces, separators, keys, tags); outside, free text."""
    kinds = ["text"] * len(text)
    pos = 0
    while (start := text.find("<tool_call>", pos)) >= 0:
        end = text.find("</tool_call>", start)
        end = len(text) if end < 0 else end + len("</tool_call>")
        for i in range(start, end):
            kinds[i] = "syntax"
        _json_kinds(text, start + len("<tool_call>"), end, kinds)
        pos = end
    return kinds


def _json_kinds(text: str, i: int, end: int, kinds: list[str]) -> None:
    # A small scanner: depth 1 is the call object, depth 2 its arguments.
    depth, key, in_args, expect_key = 0, None, False, False
    while i < end:
        c, first, nested = text[i], i, depth >= 3
        if c in "{[":
            depth += 1
            expect_key = c == "{"
            if depth == 2 and key == "arguments":
                in_args = True
        elif c in "}]":
            depth -= 1
            if depth <= 1:
                in_args = False
        elif c == '"':
            j = i + 1
            while j < end and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            body = range(i + 1, min(j, end))
            if depth == 1 and expect_key:
                key = text[i + 1 : j]
            elif depth == 1 and key == "name":
                for k in body:
                    kinds[k] = "tool_name"
            elif depth == 2 and in_args and expect_key:
                for k in body:
                    kinds[k] = "arg_name"
            elif depth == 2 and in_args:
                for k in body:
                    kinds[k] = "arg_value"
            expect_key = False
            i = j
        elif c == ":":
            expect_key = False
        elif c == ",":
            expect_key = depth in (1, 2) and text[i - 1 : i] != "]"
        elif not c.isspace() and depth == 2 and in_args:
            kinds[i] = "arg_value"  # numbers, true, false, null
        if in_args and (nested or depth >= 3):  # all of a nested value is value
            for k in range(first, min(i + 1, end)):
                kinds[k] = "arg_value"
        i += 1


def token_kinds(tokenizer, ids: list[int]) -> list[str]:
    """The kind of each token: that of the majority of its characters."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    chars = char_kinds(text)
    out, prev = [], 0
    for i in range(len(ids)):
        cut = len(tokenizer.decode(ids[: i + 1], skip_special_tokens=False))
        span = chars[prev:cut] or ["syntax"]
        out.append(max(KINDS, key=span.count))
        prev = cut
    return out


class Spy(StepObserver):
    """Which output tokens came from accepted drafts, from the scheduler's
    verdicts (the one place a verify's outcome is applied)."""

    def __init__(self, eng: Engine):
        self.marks: list[bool] = []
        eng.scheduler.add_observer(self)

    def on_verdict(self, req, draft, accepted, tokens):
        self.marks.extend(([True] * accepted + [False])[: len(tokens)])


def answer(eng: Engine, spy: Spy | None, prompt: list[int], grammar, max_tokens: int, speculative: bool) -> dict:
    with eng.session() as s:
        s.append(prompt)
        if speculative:
            s.drafter()  # a live session's index is kept across turns: built before the clock
        if spy is not None:
            spy.marks = []
        start = time.perf_counter()
        ids = s.generate(max_tokens=max_tokens, speculative=speculative, grammar=grammar)
        wall = time.perf_counter() - start
    st = eng.stats[-1]
    return {"ids": ids, "s": wall, "decode_steps": st.decode_steps, "verify_steps": st.verify_steps,
            "drafted": st.drafted_tokens, "accepted": st.accepted_tokens, "forced": st.forced_tokens,
            "forced_accepted": st.forced_accepted, "marks": list(spy.marks) if spy is not None else []}


def repeated_share(ids: list[int]) -> float:
    return sum(a == b for a, b in zip(ids, ids[1:])) / max(1, len(ids))


def verify_cost(eng: Engine, context: list[int], repeats: int) -> dict:
    """Median ms of a forward appending k + 1 tokens to a held context (k = 0:
    a decode step), through the scheduler like every forward."""
    out = {}
    with eng.session() as s:
        s.append(context)
        base = len(s)
        extra = context[: max(VERIFY_KS) + 1]
        for k in VERIFY_KS:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                s.append(extra[: k + 1])
                times.append(1e3 * (time.perf_counter() - start))
                s.truncate(base)
            out[k] = median(times)
    return {str(k): {"ms": v, "vs_decode": v / out[0]} for k, v in out.items()}


def replay(turns: list[tuple[list[int], list[int]]], make) -> float:
    """Tokens per step when each (prompt, reply) is re-drafted token by token
    with the drafter's own adaptive length (no model, no grammar), replies
    joining the namespace's outputs in order: the drafters alone, compared."""
    outputs, tokens, steps = OutputTree(), 0, 0
    for prompt, reply in turns:
        drafter = make(outputs)
        drafter.extend(prompt + reply[:1])
        pos = 1
        while pos < len(reply):
            k = min(drafter.draft_len, len(reply) - pos - 1)
            draft = drafter.propose(k) if k > 0 else []
            accepted = next((i for i, t in enumerate(draft) if t != reply[pos + i]), len(draft))
            if draft:
                drafter.record(len(draft), accepted)
            n = min(accepted + 1, len(reply) - pos)
            drafter.extend(reply[pos : pos + n])
            pos, steps = pos + n, steps + 1
        tokens += len(reply) - 1
        outputs.add(reply)
    return tokens / steps if steps else 0.0


def summarize(rows: list[dict]) -> dict:
    out = {}
    for mode in MODES:
        rs = [r[mode] for r in rows]
        generated = sum(len(r["ids"]) for r in rs)
        steps = sum(r["decode_steps"] for r in rs)
        verify = sum(r["verify_steps"] for r in rs)
        by_kind = {}
        for k in KINDS:
            n = sum(kind == k for r in rows for kind in r["kinds"])
            hit = sum(kind == k and mark for r in rows for kind, mark in zip(r["kinds"], r[mode]["marks"]))
            by_kind[k] = {"tokens": n, "from_drafts": hit / n if n else None}
        out[mode] = {
            "generated": generated, "decode_steps": steps, "verify_steps": verify,
            "drafted": sum(r["drafted"] for r in rs), "accepted": sum(r["accepted"] for r in rs),
            "forced": sum(r["forced"] for r in rs), "forced_accepted": sum(r["forced_accepted"] for r in rs),
            "accepted_per_verify": sum(r["accepted"] for r in rs) / verify if verify else 0.0,
            "tokens_per_forward": (generated - len(rs)) / steps if steps else 0.0,
            "speedup_median": median([r0["none"]["s"] / r0[mode]["s"] for r0 in rows]),
            "speedup_total": sum(r["none"]["s"] for r in rows) / sum(r["s"] for r in rs),
            "identical": all(r[mode]["ids"] == r["none"]["ids"] for r in rows),
            "by_kind": by_kind,
        }
    return out


def plot(results: dict, path) -> None:
    s, plt = results["summary"], pyplot()
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(15, 4))
    modes = list(MODES)
    left.bar(modes, [s[m]["tokens_per_forward"] for m in modes])
    left.set_ylabel("tokens per decode forward")
    mid.bar(modes, [s[m]["speedup_median"] for m in modes])
    mid.set_ylabel("decode speed-up vs none (median)")
    for ax in (left, mid):
        ax.tick_params(axis="x", rotation=30)
    width = 0.8 / (len(modes) - 1)
    for i, m in enumerate(modes[1:]):
        right.bar([k + i * width for k in range(len(KINDS))],
                  [100 * (s[m]["by_kind"][k]["from_drafts"] or 0) for k in KINDS], width, label=m)
    right.set_xticks([k + 0.4 - width / 2 for k in range(len(KINDS))], KINDS)
    right.set_ylabel("% of tokens from accepted drafts")
    right.legend(fontsize=7)
    v = results["verify_cost"]
    fig.suptitle("speculation on agent-8m tool-call turns; verify of k+1 vs decode: "
                 + ", ".join(f"k={k}: {v[k]['vs_decode']:.2f}x" for k in v if k != "0"), fontsize=9)
    save_figure(fig, path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/agent-8m")
    p.add_argument("--turns", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=2048, help="prompt window")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=7, help="timed forwards per verify width")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-mb", type=int, default=256, help="per engine")
    p.add_argument("--out", default=None, help="results folder (default: a new runs/bench_spec-*)")
    p.add_argument("--seed-base", type=int, default=D.EVAL_SEED_BASE, help="the held-out workflows' first seed")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.monotonic()
    base = Engine.from_pretrained(args.model, num_pages=1)
    kv = args.kv_cache_mb << 20
    engines = {m: Engine(base.model, base.tokenizer, kv_cache_bytes=kv,
                         **({} if cfg is None else {"drafter": cfg[0], "forced_drafts": cfg[1], "schema_drafts": cfg[2]}))
               for m, cfg in MODES.items()}
    spies = {m: Spy(e) for m, e in engines.items()}
    tok = base.tokenizer
    turns = D.eval_turns(args.turns, D.Renderer(tok), args.seq_len, D.load_split(args.model), max_reply=args.max_tokens,
                         seed_base=args.seed_base)
    rows, plain = [], []
    for turn in tqdm(turns, desc="turns", unit="turn"):
        prompt = tok.apply_chat_template(turn.messages, tools=turn.tools)
        row: dict = {"prompt_tokens": len(prompt), "agent": turn.agent, "seed": turn.seed}
        for mode, eng in engines.items():
            grammar = request_grammar(eng, turn.tools, "auto")
            row[mode] = answer(eng, spies[mode], prompt, grammar, args.max_tokens, MODES[mode] is not None)
        ids = row["none"]["ids"]
        plain.append((prompt, ids))
        row["kinds"] = token_kinds(tok, ids)
        row["repeated"] = repeated_share(ids)
        row["text"] = tok.decode(ids, skip_special_tokens=False)
        rows.append(row)
    summary = summarize(rows)
    replays = {name: replay(plain, make) for name, make in REPLAYS.items()}
    cost = verify_cost(engines["none"], tok.apply_chat_template(turns[0].messages, tools=turns[0].tools), args.repeats)
    repeated = sum(r["repeated"] * len(r["none"]["ids"]) for r in rows) / sum(len(r["none"]["ids"]) for r in rows)
    head = ["mode", "accepted/verify", "tokens/forward", "speed-up (median)", "speed-up (total)", "identical"] + \
        [f"{k} %" for k in KINDS]
    text = table(head, [[m, f"{v['accepted_per_verify']:.2f}", f"{v['tokens_per_forward']:.2f}",
                         f"{v['speedup_median']:.2f}x", f"{v['speedup_total']:.2f}x", v["identical"]]
                        + [f"{100 * v['by_kind'][k]['from_drafts']:.0f}" if v["by_kind"][k]["from_drafts"] is not None
                           else "-" for k in KINDS] for m, v in summary.items()])
    counts = {k: v["tokens"] for k, v in summary["none"]["by_kind"].items()}
    text += (f"\n{len(rows)} turns, median prompt {median([r['prompt_tokens'] for r in rows]):.0f} tokens, "
             f"{summary['none']['generated']} tokens generated per mode "
             f"({', '.join(f'{k} {counts[k]}' for k in KINDS)}); repeated tokens {100 * repeated:.1f}%; "
             f"tool calls in {sum('<tool_call>' in r['text'] for r in rows)} replies\n")
    text += table(["k drafted", "verify ms", "vs decode step"],
                  [[k, f"{v['ms']:.2f}", f"{v['vs_decode']:.2f}x"] for k, v in cost.items()])
    text += "\n" + table(["draft-only replay of the plain replies", "tokens/step"],
                         [[name, f"{v:.2f}"] for name, v in replays.items()])
    out = run_dir("bench_spec", args.out)
    for r in rows:
        for m in MODES:
            r[m].pop("marks")
    results = {"summary": summary, "verify_cost": cost, "replays": replays, "repeated_share": repeated, "rows": rows,
               "args": vars(args), "machine": machine(), "wall_s": time.monotonic() - start}
    flat = {f"{m}/{k}": v for m, s in summary.items() for k, v in s.items() if isinstance(v, (int, float, bool))}
    publish(out, results, text, plots={"plot.png": plot},
            wandb=WandbRun("bench_spec", vars(args), flat,
                           tables={"modes": (["mode", "tokens_per_forward", "speedup_median", "accepted_per_verify"],
                                             [[m, s["tokens_per_forward"], s["speedup_median"], s["accepted_per_verify"]]
                                              for m, s in summary.items()])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
