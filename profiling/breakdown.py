"""Where one turn's time goes: a per-phase breakdown of an Engine.chat turn
(template rendering, tokenization, prefill, decode, speculative verify,
drafting, sampling, detokenization and tool-call parsing, and the rest:
scheduling and session bookkeeping), plus a torch.profiler trace of the same
turn that Perfetto (ui.perfetto.dev) or chrome://tracing opens.

The phases are what the engine reports, never what a wrapper guesses: its
scheduler's observer hooks (engine.step_observer) give each forward step
(prefill, decode or verify, named by the heaviest work in it, with its
tokens) and each draft planned; its trace spans (engine.trace) give
rendering, tokenizing, sampling, detokenizing and tool-call parsing. While
this script listens, each span is also a torch.profiler range (and an NVTX
range on CUDA, for nsight), so the trace shows the same phases over the aten
ops.

The turn: --turn N of the 6- or 35-turn workflow, teacher-forced, with the
turns before it replayed first (stateful: each agent's session holds its
history, so turn N computes only its delta; stateless: the whole prompt).
It is run --repeats times, each from the same state (a new engine with the
earlier turns replayed, untimed), the median per phase reported, then once
more under torch.profiler.

    python -m agentkv.profiling.breakdown [--shape tiny|smollm2-135m | --model DIR] [--workflow 6] [--turn 4]
        [--mode stateful|stateless] [--speculative] [--max-gen 32] [--repeats 3] [--threads 2]

Cost: each measured turn (and the profiled one) replays the turns before it
on a new engine first, so on the SmolLM2-135M shape prefer an early --turn
(2: the planner's second turn) and few --repeats.

Writes runs/breakdown-<time>/{breakdown.json, trace.json, ops.txt}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from agentkv.engine.step_observer import StepObserver
from agentkv.engine.trace import add_span_listener, remove_span_listener

PHASES = ["render", "tokenize", "prefill", "decode", "verify", "draft", "sample", "detokenize", "parse_tools",
          "scheduling+bookkeeping"]
SPAN_PHASES = frozenset({"render", "tokenize", "sample", "detokenize", "parse_tools"})


class PhaseClock(StepObserver):
    """Seconds, calls and tokens per phase, from the engine's spans and its
    scheduler's steps and drafts."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.tokens.clear()

    def add(self, name: str, seconds: float, tokens: int = 0) -> None:
        self.seconds[name] += seconds
        self.calls[name] += 1
        self.tokens[name] += tokens

    def on_span(self, name: str, seconds: float) -> None:
        if name in SPAN_PHASES:  # the steps' spans are counted as steps, with their tokens
            self.add(name, seconds)

    def on_step(self, phase, items, forward_s):
        self.add(phase, forward_s, sum(len(it.tokens) for it in items))

    def on_draft(self, req, draft, seconds):
        self.add("draft", seconds)


def load_engine(args):
    from agentkv import Engine

    if args.model:
        path = Path(args.model)
    elif args.shape:
        from agentkv.experiments.drivers.checkpoint import prepare_checkpoint

        path = prepare_checkpoint(args.shape)
    else:
        path = None  # the embedded default model
    base = Engine.from_pretrained(path, dtype=args.dtype, num_pages=16)
    return base


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default=None, help="random-init shape (tiny, smollm2-135m, qwen2.5-0.5b); default: "
                   "the embedded default model")
    p.add_argument("--model", default=None, help="checkpoint directory")
    p.add_argument("--workflow", default="6", choices=["6", "35"])
    p.add_argument("--turn", type=int, default=4, help="which turn (1-based, schedule order) to break down")
    p.add_argument("--mode", default="stateful", choices=["stateful", "stateless"])
    p.add_argument("--speculative", action="store_true")
    p.add_argument("--max-gen", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from agentkv.experiments.drivers.replay import prepare_requests, workflow

    base = load_engine(args)
    wf = workflow(args.workflow, args.seed)
    reqs = prepare_requests(base.tokenizer, wf, args.turn, args.max_gen)
    if len(reqs) < args.turn:
        raise SystemExit(f"the workflow has only {len(reqs)} turns")
    need = sum({r.agent: len(r.ids) + r.gen for r in reqs}.values())
    clock = PhaseClock()
    add_span_listener(clock.on_span)
    try:
        return measure(args, base, wf, reqs, need, clock)
    finally:
        remove_span_listener(clock.on_span)


def measure(args, base, wf, reqs, need: int, clock: PhaseClock) -> dict:
    """The target turn (reqs' last) --repeats times and once profiled; the report written."""
    from agentkv import Engine
    from agentkv.experiments.common import machine, run_dir
    from agentkv.experiments.report import table

    target = reqs[-1]

    def fresh_state():
        """A new engine with the turns before the target replayed (stateful:
        each agent's session holds its history), so every measured turn
        starts from the same state, prefix cache included."""
        eng = Engine(base.model, base.tokenizer, page_size=base.pool.page_size,
                     num_pages=3 * need // base.pool.page_size + 64, stateless=args.mode == "stateless")
        eng.scheduler.add_observer(clock)
        sessions: dict[str, object] = {}
        for r in reqs[:-1]:
            s = sessions.setdefault(r.agent, eng.session()) if args.mode == "stateful" else None
            eng.chat(r.messages, tools=r.tools, session=s, max_tokens=r.gen, ignore_eos=True,
                     speculative=args.speculative)
        home = None
        if args.mode == "stateful":
            home = sessions.setdefault(target.agent, eng.session())  # empty on the agent's first turn
        return eng, home

    def one_turn(prof_ctx=None) -> tuple[float, dict]:
        eng, home = fresh_state()
        clock.reset()
        with prof_ctx if prof_ctx is not None else nullcontext():
            start = time.perf_counter()
            with record_function("turn"):
                eng.chat(target.messages, tools=target.tools, session=home, max_tokens=target.gen,
                         ignore_eos=True, speculative=args.speculative)
            total = time.perf_counter() - start
        st = eng.stats[-1]
        phases = dict(clock.seconds)
        phases["scheduling+bookkeeping"] = max(total - sum(phases.values()), 0.0)
        return total, {"phases": phases, "calls": dict(clock.calls), "tokens": dict(clock.tokens),
                       "stats": st.as_dict()}

    # The first replay warms the model up; every measured turn starts from a fresh, identical state.
    runs = [one_turn() for _ in range(args.repeats)]
    totals = [t for t, _ in runs]
    med = {ph: statistics.median([r["phases"].get(ph, 0.0) for _, r in runs]) for ph in PHASES}
    calls = {ph: runs[0][1]["calls"].get(ph, 0) for ph in PHASES}
    tokens = {ph: runs[0][1]["tokens"].get(ph, 0) for ph in PHASES}
    total = statistics.median(totals)

    out = Path(args.out) if args.out else run_dir("breakdown")
    out.mkdir(parents=True, exist_ok=True)
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    one_turn(prof)  # only the target turn is inside the profiler
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    (out / "ops.txt").write_text(ops + "\n")

    rows = [[ph, med[ph] * 1e3, f"{100 * med[ph] / total:.1f}%", calls[ph], tokens[ph] or ""] for ph in PHASES]
    rows.append(["total (Engine.chat)", total * 1e3, "100%", "", ""])
    text = table(["phase", "ms", "share", "calls", "tokens"], rows)
    st = runs[0][1]["stats"]
    head = (f"turn {args.turn} ({target.agent}) of the {wf.shape} workflow, {args.mode}: prompt {len(target.ids)} "
            f"tokens, reused {st['reused_tokens']}, computed {st['computed_tokens']}, generated "
            f"{st['generated_tokens']} in {st['decode_steps']} decode steps; median of {args.repeats}")
    print(head)
    print(text)
    print("\ntop aten ops of the profiled turn:\n" + ops)
    res = {"command": " ".join([sys.executable, "-m", "agentkv.profiling.breakdown", *sys.argv[1:]]), "args": vars(args),
           "machine": machine(), "turn": {"index": args.turn, "agent": target.agent, "prompt": len(target.ids),
                                          "gen": target.gen},
           "median_ms": {ph: v * 1e3 for ph, v in med.items()}, "total_ms": total * 1e3, "calls": calls,
           "tokens": tokens, "repeats": [r for _, r in runs], "trace": str(trace)}
    (out / "breakdown.json").write_text(json.dumps(res, indent=2))
    (out / "breakdown.txt").write_text(head + "\n" + text + "\n")
    print(f"wrote {out}/breakdown.json and {trace} (open in https://ui.perfetto.dev)")
    return res


if __name__ == "__main__":
    main()
