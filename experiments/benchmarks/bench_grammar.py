"""What grammar-constrained decoding costs per step and what it buys, on the
project's trained agent model and its held-out tool-call turns.

    python -m agentkv.experiments.benchmarks.bench_grammar [--model models/agent-8m] [--turns 12] [--threads 1]

Per turn the prompt is computed once on a session; each mode then answers
greedily from it (truncating back in between), without speculation so that a
decode step is one token:

- free: the tools are offered, nothing is constrained;
- auto: tool_choice "auto": text is free, a call the model opens is held to
  the offered tools and their schemas;
- required: tool_choice "required": a call to an offered tool, nothing else.

Reported per mode: valid tool-call JSON, right tool, exact arguments
(experiments.default_model.eval.score), decode ms/step (wall time of the
answer per token, which without speculation is per step: median over turns
of each turn's median over --repeats), and for the constrained modes the cost of
masking alone (matcher fill + mask application per token, replayed over the
reply). "required" also runs with speculation, whose greedy output must be
identical. Writes a table, runs/bench_grammar-*/results.json and plot.png.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from agentkv import Engine
from agentkv.engine.grammar import GrammarState
from agentkv.engine.structured import request_grammar
from agentkv.experiments.common import machine, median, run_dir
from agentkv.experiments.default_model import data as D
from agentkv.experiments.default_model.eval import score
from agentkv.experiments.report import pyplot, save_figure, table, write_json

MODES = {"free": None, "auto": "auto", "required": "required"}


def mask_ms(state: GrammarState, reply: list[int], vocab: int) -> float:
    """Median ms to mask one step's logits, replayed over the reply's tokens."""
    rows, times = torch.zeros(1, vocab), []
    for token in reply:
        start = time.perf_counter()
        state.masked(rows, [])
        times.append(1e3 * (time.perf_counter() - start))
        if not state.accept(token):
            break
    return median(times)


def answer(eng: Engine, s, prompt_len: int, grammar, max_tokens: int, speculative: bool) -> tuple[list[int], float]:
    s.truncate(prompt_len)
    start = time.perf_counter()
    ids = s.generate(max_tokens=max_tokens, speculative=speculative, grammar=grammar)
    # Wall time, not the forward's: masking and the matcher run between forwards.
    return ids, 1e3 * (time.perf_counter() - start) / len(ids)


def bench_turn(eng: Engine, renderer: D.Renderer, turn: D.EvalTurn, max_tokens: int, repeats: int) -> dict:
    prompt = eng.tokenizer.apply_chat_template(turn.messages, tools=turn.tools)
    prompt_text = renderer.render(turn.messages, turn.tools, True)
    row: dict = {"prompt_tokens": len(prompt)}
    vocab = eng.model.cfg.vocab_size
    with eng.session() as s:
        s.append(prompt)
        for mode, choice in MODES.items():
            grammar = request_grammar(eng, turn.tools, choice) if choice else None
            runs = [answer(eng, s, len(prompt), grammar, max_tokens, speculative=False) for _ in range(repeats)]
            ids = runs[0][0]
            text = eng.tokenizer.decode(ids, skip_special_tokens=True)
            row[mode] = {**score(text, turn.reference, prompt_text), "generated": len(ids),
                         "ms_per_step": median([ms for _, ms in runs])}
            if grammar is not None:
                row[mode]["mask_ms"] = mask_ms(GrammarState(grammar), ids, vocab)
            if mode == "required":
                spec_ids, _ = answer(eng, s, len(prompt), grammar, max_tokens, speculative=True)
                row[mode]["identical_with_speculation"] = spec_ids == ids
                st = eng.stats[-1]
                row[mode]["spec"] = {"drafted": st.drafted_tokens, "accepted": st.accepted_tokens,
                                     "forced": st.forced_tokens, "forced_accepted": st.forced_accepted,
                                     "tokens": len(spec_ids), "decode_steps": st.decode_steps}
    return row


def summarize(rows: list[dict]) -> dict:
    out = {}
    for mode in MODES:
        rs = [r[mode] for r in rows]
        out[mode] = {
            **{k: sum(bool(r[k]) for r in rs) / len(rs) for k in ("valid_json", "right_tool", "exact_args")},
            "ms_per_step": median([r["ms_per_step"] for r in rs]),
            "mask_ms": median([r["mask_ms"] for r in rs]) if "mask_ms" in rs[0] else None,
        }
    req = [r["required"] for r in rows]
    out["required"]["identical_with_speculation"] = all(r["identical_with_speculation"] for r in req)
    out["required"]["drafted"] = sum(r["spec"]["drafted"] for r in req)
    for key in ("accepted", "forced", "forced_accepted", "tokens", "decode_steps"):
        out["required"][key] = sum(r["spec"][key] for r in req)
    return out


def plot(summary: dict, path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    keys, width = ("valid_json", "right_tool", "exact_args"), 0.25
    for i, mode in enumerate(MODES):
        left.bar([k + i * width for k in range(len(keys))], [100 * summary[mode][k] for k in keys], width, label=mode)
    left.set_xticks([k + width for k in range(len(keys))], keys)
    left.set_ylabel("% of turns")
    left.legend()
    right.bar(list(MODES), [summary[m]["ms_per_step"] for m in MODES])
    right.set_ylabel("decode ms/step (median)")
    fig.suptitle("grammar-constrained decoding on agent-8m")
    save_figure(fig, path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/agent-8m")
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=2048, help="prompt window")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=3, help="timed answers per mode and turn")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.monotonic()
    eng = Engine.from_pretrained(args.model)
    renderer = D.Renderer(eng.tokenizer)
    turns = D.eval_turns(args.turns, renderer, args.seq_len, D.load_split(args.model), max_reply=args.max_tokens)
    rows = [bench_turn(eng, renderer, t, args.max_tokens, args.repeats) for t in turns]
    summary = summarize(rows)
    head = ["mode", "valid JSON %", "right tool %", "exact args %", "decode ms/step", "mask ms/step"]
    print(table(head, [[m, 100 * v["valid_json"], 100 * v["right_tool"], 100 * v["exact_args"], v["ms_per_step"],
                        "-" if v["mask_ms"] is None else f"{v['mask_ms']:.3f}"] for m, v in summary.items()]))
    req = summary["required"]
    print(f"{len(rows)} turns, median prompt {statistics.median(r['prompt_tokens'] for r in rows)} tokens; "
          f"required with speculation: identical greedy output {req['identical_with_speculation']}, "
          f"{req['accepted']}/{req['drafted']} drafted tokens accepted ({req['forced_accepted']}/{req['forced']} of "
          f"those the grammar forced), {req['tokens'] / req['decode_steps']:.2f} tokens per decode step; "
          f"grammars compiled: {eng.grammars.compiles}")
    out = run_dir("bench_grammar")
    write_json(out / "results.json", {"summary": summary, "rows": rows, "args": vars(args), "machine": machine(),
                                      "wall_s": time.monotonic() - start})
    plot(summary, out / "plot.png")
    print(f"wrote {out}/results.json and plot.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
