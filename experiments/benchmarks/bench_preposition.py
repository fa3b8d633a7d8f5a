"""Time to first token of a tool-result turn, with and without
pre-positioning (engine.turn: after a turn that ends on tool calls the
session holds the template's opening of the tool result, and the idle
scheduler computes it, with the reply's last token, while the tool runs).

Two engines on the embedded trained model (shared weights, scheduler loops
running), one with Engine(preposition=False). Per repeat, on each engine
alternately: a fresh session, a turn that calls get_weather, a tool pause
of --pause seconds, then the tool result's turn, whose first token's
arrival (the on_tokens callback) is timed from its submission. Medians.

    python -m agentkv.experiments.benchmarks.bench_preposition [--repeats 15] [--pause 0.2] [--result-tokens 30]
"""
from __future__ import annotations

import argparse
import json
import threading
import time

from tqdm import tqdm

from agentkv import Engine
from agentkv.experiments.common import machine, median, run_dir
from agentkv.experiments.report import WandbRun, publish, table

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CITIES = ["Oslo", "Lima", "Baku", "Nuuk", "Kyiv", "Cairo", "Quito", "Accra", "Hanoi", "Perth"]
SYSTEMS = ("preposition", "no-preposition")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--pause", type=float, default=0.2, help="seconds the tool runs")
    p.add_argument("--result-tokens", type=int, default=30, help="about this many tokens of tool result")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def first_token_s(engine: Engine, city: str, pause: float, result_words: int) -> tuple[float, int]:
    """Seconds to the tool-result turn's first token, and its prompt tokens computed."""
    with engine.session() as s:
        messages = [{"role": "user", "content": f'Next step: call get_weather with city="{city}".'}]
        r = engine.chat(messages, TOOLS, session=s, max_tokens=48, temperature=0.0)
        calls = [{"id": c["id"], "type": "function",
                  "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in r.tool_calls]
        result = {"city": city, "report": " ".join(["sunny"] * result_words)}
        messages += [{"role": "assistant", "content": r.text or None, "tool_calls": calls or None},
                     {"role": "tool", "tool_call_id": "call_1", "content": json.dumps(result)}]
        time.sleep(pause)
        first = threading.Event()
        start = time.perf_counter()
        turn = engine.start_chat(messages, TOOLS, session=s, max_tokens=4, temperature=0.0,
                                 on_tokens=lambda ids: first.set())
        first.wait(60)
        elapsed = time.perf_counter() - start
        done = turn.wait()
        return elapsed, done.usage["computed_tokens"]


def run(args: argparse.Namespace) -> dict:
    on = Engine.from_pretrained(num_pages=1024)
    engines = {"preposition": on, "no-preposition": Engine(on.model, on.tokenizer, num_pages=1024, preposition=False)}
    for e in engines.values():
        e.scheduler.start()
    times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    computed: dict[str, list[int]] = {s: [] for s in SYSTEMS}
    try:
        for i in tqdm(range(args.repeats), desc="repeats"):
            order = SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]
            for name in order:
                t, c = first_token_s(engines[name], CITIES[i % len(CITIES)], args.pause, args.result_tokens)
                times[name].append(t)
                computed[name].append(c)
    finally:
        for e in engines.values():
            e.scheduler.stop()
    rows = [{"system": s, "ttft_ms_median": 1000 * median(times[s]), "computed_tokens_median": median(computed[s]),
             "ttft_ms": [1000 * t for t in times[s]]} for s in SYSTEMS]
    return {"machine": machine(), "args": vars(args), "rows": rows,
            "ratio": rows[0]["ttft_ms_median"] / rows[1]["ttft_ms_median"]}


def report(res: dict) -> str:
    rows = [[r["system"], f"{r['ttft_ms_median']:.1f}", r["computed_tokens_median"]] for r in res["rows"]]
    return ("Time to first token of a tool-result turn (medians)\n"
            + table(["system", "TTFT ms", "prompt tokens computed"], rows)
            + f"\npre-positioned / not: {res['ratio']:.2f}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    res = run(args)
    out = run_dir("bench_preposition", args.out)
    publish(out, res, report(res), wandb=WandbRun("bench_preposition", vars(args), {"ttft_ratio": res["ratio"]}))
    return res


if __name__ == "__main__":
    main()
