"""What one forward of the engine costs at a given context, for kernel work:
a prefill chunk over the cached context, a decode step and a speculative
verify, per dtype, with the oneDNN-packed linears on and off
(Transformer.prepack), on a random-init model.

One session per dtype grows to each --contexts length in turn (untimed
chunks); at each length every step is timed --repeats times with packing on, then
off, the session cut back to that length after each. Medians are reported.

    python -m agentkv.experiments.benchmarks.bench_steps [--shape smollm2-135m] [--dtypes float32,bfloat16]
        [--contexts 2048,8192,16384] [--chunk 1024] [--verify 8] [--repeats 5] [--threads 1]

Writes runs/bench_steps-<time>/{results.json, steps.png}.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from tqdm import tqdm

from agentkv import Engine
from agentkv.experiments.common import SHAPES, machine, median, run_dir
from agentkv.experiments.report import pyplot, save_figure, table, write_json
from agentkv.model.config import ModelConfig
from agentkv.model.default import random_init
from agentkv.model.llama import Transformer

STEPS = ("prefill", "decode", "verify")


def timed(session, tokens: list[int], all_logits: bool) -> float:
    start = len(session)
    t = time.perf_counter()
    session.append(tokens, all_logits=all_logits)
    seconds = time.perf_counter() - t
    session.truncate(start)
    return seconds


def run(args) -> dict:
    contexts = sorted(int(c) for c in args.contexts.split(","))
    shape = dict(SHAPES[args.shape])
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], contexts[-1] + args.chunk + 16)
    gen = torch.Generator().manual_seed(args.seed)
    results = []
    dtypes = args.dtypes.split(",")
    bar = tqdm(total=len(dtypes) * len(contexts) * 2 * args.repeats, desc="steps")
    for dtype in dtypes:
        model = Transformer(ModelConfig.from_hf(shape), getattr(torch, dtype))
        random_init(model, args.seed)
        engine = Engine(model, None, page_size=args.page_size,
                        kv_cache_bytes=args.kv_gb << 30)
        vocab = model.cfg.vocab_size
        session = engine.session()
        for context in contexts:
            while len(session) < context:
                session.append(torch.randint(0, vocab, (min(2048, context - len(session)),), generator=gen).tolist())
            chunk = torch.randint(0, vocab, (args.chunk,), generator=gen).tolist()
            draft = chunk[: args.verify]
            times: dict[tuple[bool, str], list[float]] = defaultdict(list)
            for packed in (True, False):
                model.prepack(packed)
                timed(session, draft, True)  # oneDNN sets up its kernels on first use
                for _ in range(args.repeats):
                    times[packed, "prefill"].append(timed(session, chunk, False))
                    times[packed, "decode"].append(timed(session, chunk[:1], False))
                    times[packed, "verify"].append(timed(session, draft, True))
                    bar.update()
            for packed in (True, False):
                results.append({"dtype": dtype, "context": context, "packed": packed,
                                **{f"{s}_ms": median(times[packed, s]) * 1e3 for s in STEPS}})
        session.close()
        model.prepack()
    bar.close()
    return {"args": vars(args), "machine": machine(), "results": results}


def plot(res: dict, path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, step in zip(axes, STEPS):
        lines = defaultdict(list)
        for r in res["results"]:
            lines[r["dtype"], r["packed"]].append((r["context"], r[f"{step}_ms"]))
        for (dtype, packed), points in lines.items():
            ax.plot(*zip(*points), "o-" if packed else "s--", label=f"{dtype}{' packed' if packed else ''}")
        ax.set_xlabel("cached context (tokens)")
        ax.set_ylabel("ms")
        a = res["args"]
        ax.set_title({"prefill": f"prefill {a['chunk']} tokens", "decode": "decode step",
                      "verify": f"verify {a['verify']} tokens"}[step])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{res['args']['shape']}, {res['args']['threads']} thread(s), median of {res['args']['repeats']}")
    save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--contexts", default="2048,8192,16384")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk length")
    p.add_argument("--verify", type=int, default=8, help="tokens in a verify step")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-gb", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = run_dir("bench_steps")
    res = run(args)
    rows = []
    for r in res["results"]:
        rows.append([r["dtype"], r["context"], "on" if r["packed"] else "off",
                     r["prefill_ms"], args.chunk / r["prefill_ms"] * 1e3, r["decode_ms"], r["verify_ms"]])
    print(table(["dtype", "context", "packed", f"prefill {args.chunk} ms", "prefill tok/s", "decode ms",
                 f"verify {args.verify} ms"], rows))
    write_json(out / "results.json", res)
    plot(res, out / "steps.png")
    print(f"wrote {out}/results.json and steps.png")


if __name__ == "__main__":
    main()
