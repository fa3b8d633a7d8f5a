"""Host work of a chat turn on a session against the length of its history:
what it takes, before any forward, to find what the session holds and what
to compute, per continuation mode (engine.turn).

- template-faithful: render the whole conversation, tokenize it, compare
  it with the session's tokens (cache.tokens.common_prefix_len);
- native: a digest per message, the message log's match, the new messages
  rendered from the anchor (model.chat_suffix) and tokenized.

An agent conversation of tool calls and tool results (the embedded default
model's tokenizer and template) is grown to each length; the session holds
it as a finished turn would (tokens held, not computed: no forward runs),
and the next request adds a tool result. Medians of --repeats, the modes
alternating.

    python -m agentkv.experiments.benchmarks.bench_host_work [--lengths 1000,10000,100000] [--repeats 7]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from agentkv import Engine
from agentkv.engine.turn import native_prompt, rendered_prompt
from agentkv.engine.message_log import MessageLog, digest, tools_digest
from agentkv.experiments.common import machine, median, run_dir
from agentkv.experiments.report import WandbRun, publish, pyplot, save_figure, table

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
MODES = ("template-faithful", "native")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1000,3000,10000,30000,100000", help="history lengths, in tokens")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def conversation(engine: Engine, tokens: int) -> list[dict]:
    """An agent's history of about `tokens` tokens, ending on its tool call."""
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Find where the scheduler preempts requests."}]
    i = 0
    while True:
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/module_{i}.py"})}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        if len(engine.tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False)) >= tokens:
            return messages
        body = "\n".join(f"def f_{i}_{j}(x):\n    return x * {j}  # line {j}" for j in range(40))
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": body})
        i += 1


def held_session(engine: Engine, history: list[dict]):
    """A session holding history as its finished turn would: tokens up to the
    reply's end-of-turn token, the log naming its messages."""
    text = engine.tokenizer.apply_chat_template(history, tools=TOOLS, add_generation_prompt=False, tokenize=False)
    gap = "\n"  # the embedded template's text after <|im_end|>
    assert text.endswith("<|im_end|>" + gap)
    tokens = engine.tokenizer.encode(text[: -len(gap)])
    session = engine.session(tokens=tokens)
    session.message_log = MessageLog(tuple(digest(m) for m in history), tools_digest(TOOLS), len(tokens), gap)
    return session


def host_work(engine: Engine, session, messages: list[dict], mode: str) -> tuple[float, int]:
    """Seconds to plan the turn, and the tokens it would queue."""
    start = time.perf_counter()
    if mode == "native":
        prompt = native_prompt(engine, session, messages, TOOLS)
        assert prompt is not None, "the log did not match"
    else:
        prompt = rendered_prompt(engine, session, messages, TOOLS)
    return time.perf_counter() - start, len(prompt.ids)


def run(args: argparse.Namespace) -> dict:
    engine = Engine.from_pretrained(num_pages=64)
    rows = []
    for length in tqdm([int(x) for x in args.lengths.split(",")], desc="history lengths"):
        history = conversation(engine, length)
        session = held_session(engine, history)
        request = history + [{"role": "tool", "tool_call_id": "call_new", "content": "print('the new result')"}]
        times: dict[str, list[float]] = {m: [] for m in MODES}
        queued = {}
        for _ in range(args.repeats):
            for mode in MODES:
                seconds, queued[mode] = host_work(engine, session, request, mode)
                times[mode].append(seconds)
        held = len(session)
        session.close()
        rows.append({"history_tokens": held, "messages": len(request),
                     **{f"{m}_ms": 1000 * median(times[m]) for m in MODES},
                     **{f"{m}_queued": queued[m] for m in MODES}})
    return {"machine": machine(), "args": vars(args), "rows": rows}


def report(res: dict) -> str:
    headers = ["history tokens", "messages", "template-faithful ms", "native ms", "ratio", "queued (tf / native)"]
    rows = [[r["history_tokens"], r["messages"], f"{r['template-faithful_ms']:.2f}", f"{r['native_ms']:.2f}",
             f"{r['template-faithful_ms'] / r['native_ms']:.0f}x",
             f"{r['template-faithful_queued']} / {r['native_queued']}"] for r in res["rows"]]
    return ("Host work of one chat turn on a session (render + tokenize + match; no forward), medians\n"
            + table(headers, rows))


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["history_tokens"] for r in res["rows"]]
    for mode in MODES:
        ax.plot(xs, [r[f"{mode}_ms"] for r in res["rows"]], marker="o", label=mode)
    ax.set(xscale="log", yscale="log", xlabel="history (tokens)", ylabel="host work per turn (ms)",
           title="Finding what a session holds")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    res = run(args)
    out = run_dir("bench_host_work", args.out)
    summary = {f"{m}_ms_{r['history_tokens']}": r[f"{m}_ms"] for r in res["rows"] for m in MODES}
    publish(out, res, report(res), {"host_work.png": plot},
            WandbRun("bench_host_work", vars(args), summary,
                     tables={"rows": (list(res["rows"][0]), [list(r.values()) for r in res["rows"]])}))
    return res


if __name__ == "__main__":
    main()
