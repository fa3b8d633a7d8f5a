"""Host overhead of a decode step: what a step costs beyond the ops it runs.

B sessions of the embedded model (models/agent-8m) are grown to --context
tokens each (distinct random tokens, so nothing is shared), then decode
--tokens tokens side by side (greedy, no speculation unless --speculative,
the demo's default; the scheduler batches them into steps of B). Per batch
size and thread count:

- tokens/s (batch 1: one session's decode rate) and ms per step: wall time of the whole decode over the steps
  it took (scheduler, forward, emit: everything a user waits for); the
  forward's share from the scheduler's own counters;
- the ops: after each timed decode, one of --profile-tokens under
  torch.profiler; every top-level torch op of the step (one no other op
  encloses) counted and its time summed;
- host overhead = the profiled step's wall - its op time - what the
  profiler itself adds between ops (calibrated on a loop of tiny ops, timed
  with and without it): the Python between the ops, in the same run as the
  ops it is set against. The spans of recorded ops are not lengthened by
  the profiler (a tiny op's span is shorter than its unprofiled call).
- outside the loop = the timed decode's wall - the time its steps spent in
  the C++ layer loop (kernels/cpu_layers.forward, timed around each call),
  per step: the Python of the scheduler, the runner and the model around the
  ops, measured without the profiler; "-" where a step ran no C++ loop (its
  linears not the C++ kernel's, or a GPU).

Medians of --repeats; the sessions are cut back to --context after each.

    python -m agentkv.experiments.benchmarks.bench_host_step [--model models/agent-8m] [--dtypes float32,bfloat16]
        [--context 8192] [--batches 1,8] [--tokens 64] [--profile-tokens 8] [--repeats 5] [--threads 1,2]
        [--speculative]

Writes runs/bench_host_step-<time>/{results.json, report.txt} (or --out).
"""
from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from agentkv import Engine
from agentkv.experiments.common import machine, median, run_dir
from agentkv.experiments.report import publish, table
from agentkv.kernels import cpu_layers
from agentkv.model.default import small_model_dir


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded models/agent-8m)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--context", type=int, default=8192, help="tokens each session holds before decoding")
    p.add_argument("--batches", default="1,8", help="sessions decoding side by side")
    p.add_argument("--tokens", type=int, default=64, help="tokens each session decodes per repeat")
    p.add_argument("--profile-tokens", type=int, default=8, help="tokens each session decodes under the profiler")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", default="1", help="torch threads, a list: each is a row of its own")
    p.add_argument("--speculative", action="store_true",
                   help="decode as the demo does, drafts verified (the ms per step are then per verify step)")
    p.add_argument("--kv-gb", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def top_level_ops(prof) -> list:
    """The profiled CPU ops of the main thread that no other op encloses."""
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    main = Counter(e.thread for e in events).most_common(1)[0][0]
    events = sorted((e for e in events if e.thread == main), key=lambda e: (e.time_range.start, -e.time_range.end))
    top, end = [], -1
    for e in events:
        if e.time_range.start >= end:
            top.append(e)
            end = e.time_range.end
    return top


def profiler_cost_per_op(n: int = 20000) -> float:
    """Seconds the profiler adds to the wall time per recorded op, outside
    the op's own span: a loop of tiny adds timed with and without it (their
    spans are no longer than the unprofiled calls, so all of the difference
    lies between them)."""
    x = torch.zeros(8)

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(n):
            torch.add(x, x)
        return time.perf_counter() - start

    plain = min(loop() for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU]):
        profiled = loop()
    return max(0.0, profiled - plain) / n


class LoopTimer:
    """Wall seconds spent in the C++ layer loop while it is installed, and
    the calls: each forward of a step that runs its layers there is one."""

    def __enter__(self) -> "LoopTimer":
        self.seconds, self.calls = 0.0, 0
        real = self._real = cpu_layers.forward

        def timed(*args):
            start = time.perf_counter()
            try:
                return real(*args)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        cpu_layers.forward = timed
        return self

    def __exit__(self, *exc) -> None:
        cpu_layers.forward = self._real


def decode(engine: Engine, sessions: list, tokens: int, speculative: bool = False) -> tuple[float, int, float]:
    """Wall seconds, steps and forward seconds of one side-by-side decode."""
    counters = engine.scheduler.counters
    steps, forward = counters.steps, counters.forward_s
    start = time.perf_counter()
    reqs = [s.start_generate(max_tokens=tokens, ignore_eos=True, speculative=speculative) for s in sessions]
    for r in reqs:
        engine.scheduler.wait(r)
        if r.error is not None:
            raise r.error
    return time.perf_counter() - start, counters.steps - steps, counters.forward_s - forward


def measure(engine: Engine, batch: int, args, bar) -> dict:
    gen = torch.Generator().manual_seed(args.seed + batch)
    vocab = engine.model.cfg.vocab_size
    sessions = [engine.session() for _ in range(batch)]
    for s in sessions:
        while len(s) < args.context:
            s.append(torch.randint(3, vocab, (min(2048, args.context - len(s)),), generator=gen).tolist())

    def reset() -> None:
        for s in sessions:
            s.truncate(args.context)

    decode(engine, sessions, 4)  # oneDNN sets up its kernels on first use
    reset()
    walls, per_step, forwards, hosts, outside, op_times, op_counts = [], [], [], [], [], [], []
    by_name, count = Counter(), Counter()
    for _ in range(args.repeats):
        with LoopTimer() as loop:
            wall, steps, forward = decode(engine, sessions, args.tokens, args.speculative)
        reset()
        if loop.calls == steps:
            outside.append((wall - loop.seconds) / steps)
        walls.append(wall)
        per_step.append(wall / steps)
        forwards.append(forward / steps)
        # Right after, so that both see the machine alike (it is shared).
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            profiled_wall, steps, _ = decode(engine, sessions, args.profile_tokens, args.speculative)
        reset()
        ops = top_level_ops(prof)
        op_s = sum(e.time_range.elapsed_us() for e in ops) * 1e-6 / steps
        op_times.append(op_s)
        op_counts.append(len(ops) / steps)
        hosts.append(profiled_wall / steps - op_s - len(ops) / steps * args.profiler_cost_s)
        for e in ops:
            by_name[e.name] += e.time_range.elapsed_us() / steps / args.repeats
            count[e.name] += 1 / steps / args.repeats
        bar.update()
    for s in sessions:
        s.close()
    step_s, host_s = median(per_step), median(hosts)
    return {
        "batch": batch, "context": args.context,
        "tokens_per_s": batch * args.tokens / median(walls),
        "step_ms": step_s * 1e3, "forward_ms": median(forwards) * 1e3,
        "ops_per_step": median(op_counts), "op_ms": median(op_times) * 1e3,
        "host_ms": host_s * 1e3, "host_share": host_s / step_s,
        "outside_loop_ms": median(outside) * 1e3 if len(outside) == args.repeats else None,
        "top_ops": [{"op": k, "calls": round(count[k], 1), "us": round(v, 1)} for k, v in by_name.most_common(12)],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = run_dir("bench_host_step", args.out)
    path = Path(args.model) if args.model else small_model_dir()
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = args.dtypes.split(",")
    threads = [int(t) for t in args.threads.split(",")]
    rows = []
    bar = tqdm(total=len(dtypes) * len(batches) * len(threads) * args.repeats, desc="decode")
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        args.profiler_cost_s = profiler_cost_per_op()
        for dtype in dtypes:
            engine = Engine.from_pretrained(path, dtype=dtype, kv_cache_bytes=int(args.kv_gb * 2**30),
                                            prefix_cache=False)
            for batch in batches:
                rows.append({"dtype": dtype, "threads": n_threads, **measure(engine, batch, args, bar)})
    bar.close()
    text = table(
        ["dtype", "threads", "batch", "context", "tok/s", "step ms", "forward ms", "ops/step", "op ms", "host ms",
         "host %", "outside loop ms"],
        [[r["dtype"], r["threads"], r["batch"], r["context"], r["tokens_per_s"], r["step_ms"], r["forward_ms"],
          r["ops_per_step"], r["op_ms"], r["host_ms"], 100 * r["host_share"],
          "-" if r["outside_loop_ms"] is None else r["outside_loop_ms"]] for r in rows],
    )
    for r in rows:
        text += f"\n\n{r['dtype']}, {r['threads']} thread(s), batch {r['batch']}, top ops per step:\n" + table(
            ["op", "calls", "us"], [[o["op"], o["calls"], o["us"]] for o in r["top_ops"]])
    publish(out, {"args": vars(args), "machine": machine(), "rows": rows}, text)


if __name__ == "__main__":
    main()
