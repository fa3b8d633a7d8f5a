"""One stream's decode, driven inline and served by the scheduler thread.

One session of the model holds --context tokens (distinct random ones,
computed before timing), then decodes --tokens tokens (greedy, ignore_eos,
no speculation), cut back to --context after each run. The same engine
decodes it two ways, alternated run by run so that both see the machine
alike (it is shared):

- inline: no scheduler thread; the caller's thread steps the scheduler
  (Engine.wait), as a script or a test drives the engine;
- served: the scheduler thread runs (Engine.start_serving), as serve.py
  runs it, and the caller's thread runs an asyncio loop that receives each
  step's tokens as the server's handlers do (engine.api.generation:
  callbacks posted to the loop).

ms/token is the decode's wall time over its tokens; forward ms is the
scheduler's own forward time per step. Medians of --repeats per mode;
served/inline is the ratio of the medians.

    python -m agentkv.experiments.benchmarks.bench_served_stream [--model PATH] [--dtype auto]
        [--threads 2] [--context 3512] [--tokens 128] [--repeats 5]

--dtype auto: bfloat16 where the CPU has avx512_bf16, else float32. With no
--model, the embedded default model (Engine.from_pretrained()).
Writes runs/bench_served_stream-<time>/{results.json, report.txt} (or --out).
"""
from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import torch
from tqdm import tqdm

from agentkv import Engine
from agentkv.engine.api.generation import Generation
from agentkv.experiments.common import machine, median, run_dir
from agentkv.experiments.report import publish, table

MODES = ("inline", "served")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded default model)")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 with avx512_bf16, else float32")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--context", type=int, default=3512, help="tokens the session holds before decoding")
    p.add_argument("--tokens", type=int, default=128, help="tokens decoded per run")
    p.add_argument("--repeats", type=int, default=5, help="runs per mode")
    p.add_argument("--kv-gb", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def decode_inline(engine: Engine, session, tokens: int) -> list[int]:
    req = engine.wait(session.start_generate(max_tokens=tokens, ignore_eos=True, speculative=False))
    if req.error is not None:
        raise req.error
    return req.output


async def _stream(session, tokens: int) -> list[int]:
    gen = await Generation.begin(lambda on_tokens, on_done: session.start_generate(
        max_tokens=tokens, ignore_eos=True, speculative=False, on_tokens=on_tokens, on_done=on_done))
    return [t async for ids in gen.tokens() for t in ids]


def decode_served(engine: Engine, session, tokens: int) -> list[int]:
    engine.start_serving()
    try:
        return asyncio.run(_stream(session, tokens))
    finally:
        engine.stop_serving()


def timed(decode, engine: Engine, session, tokens: int) -> dict:
    counters = engine.scheduler.counters
    steps, forward = counters.steps, counters.forward_s
    start = time.perf_counter()
    out = decode(engine, session, tokens)
    wall = time.perf_counter() - start
    if len(out) != tokens:
        raise RuntimeError(f"decoded {len(out)} tokens, not {tokens}")
    steps = counters.steps - steps
    return {"ms_per_token": wall / tokens * 1e3, "forward_ms": (counters.forward_s - forward) / steps * 1e3,
            "output": out}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = run_dir("bench_served_stream", args.out)
    torch.set_num_threads(args.threads)
    host = machine()
    dtype = args.dtype if args.dtype != "auto" else "bfloat16" if "avx512_bf16" in host["isa"] else "float32"
    engine = Engine.from_pretrained(Path(args.model) if args.model else None, dtype=dtype,
                                    kv_cache_bytes=int(args.kv_gb * 2**30), prefix_cache=False)
    gen = torch.Generator().manual_seed(args.seed)
    session = engine.session()
    while len(session) < args.context:
        n = min(512, args.context - len(session))
        session.append(torch.randint(3, engine.vocab_size, (n,), generator=gen).tolist())
    decodes = {"inline": decode_inline, "served": decode_served}
    for mode in MODES:  # oneDNN sets up its kernels on first use, in each thread
        decodes[mode](engine, session, 4)
        session.truncate(args.context)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in tqdm(range(args.repeats), desc="runs"):
        for mode in MODES:
            runs[mode].append(timed(decodes[mode], engine, session, args.tokens))
            session.truncate(args.context)
    if runs["inline"][0]["output"] != runs["served"][0]["output"]:
        raise RuntimeError("the served decode drew other tokens than the inline one")
    rows = [{"mode": m, "ms_per_token": median([r["ms_per_token"] for r in runs[m]]),
             "forward_ms": median([r["forward_ms"] for r in runs[m]]),
             "runs_ms_per_token": [round(r["ms_per_token"], 3) for r in runs[m]]} for m in MODES]
    ratio = rows[1]["ms_per_token"] / rows[0]["ms_per_token"]
    text = table(["mode", "dtype", "threads", "context", "tokens", "ms/token", "forward ms", "runs ms/token"],
                 [[r["mode"], dtype, args.threads, args.context, args.tokens, r["ms_per_token"], r["forward_ms"],
                   " ".join(f"{x:.2f}" for x in r["runs_ms_per_token"])] for r in rows])
    text += f"\n\nserved/inline: {ratio:.3f}  (host: {host['cpu']}, {' '.join(host['isa'])})"
    publish(out, {"args": vars(args), "dtype": dtype, "machine": host, "rows": rows,
                  "served_over_inline": ratio}, text)


if __name__ == "__main__":
    main()
