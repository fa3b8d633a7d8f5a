"""Prompt-chunk attention on CPU: the C++ chunk kernel (kernels/cpu_chunk_attention.py)
against the torch reference it replaced (torch's CPU flash kernel in fp32,
oneDNN matmuls per query block in bf16), then whole prefills with one and
the other.

Attention: one sequence per (chunk, cached) shape, its pages scattered over
a pool, the SmolLM2-135M shape's heads by default; kernel and reference
alternate within each repeat; GFLOP/s counts the causal work only
(4 * heads * head_dim per visible query-key pair).

Prefill: a random-init --shape model prefills --prefill-tokens in the
engine's chunks, with the chunk kernel and then without it (its extension
marked unavailable, as on a machine without a compiler: the reference runs),
alternating per repeat.

    python -m agentkv.experiments.benchmarks.bench_chunk_attention [--shapes 512x0,512x8192,512x16384,2048x0]
        [--dtypes float32,bfloat16] [--threads 1,2] [--repeats 5] [--prefill-tokens 8192]
        [--prefill-repeats 2] [--skip-prefill] [--out DIR]

Writes runs/bench_chunk_attention-<time>/{results.json, report.txt, chunk_attention.png, wandb/}.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
from tqdm import tqdm

from agentkv import Engine
from agentkv.experiments.common import SHAPES, machine, median, run_dir
from agentkv.experiments.report import WandbRun, publish, pyplot, save_figure, table
from agentkv.kernels import cpu_chunk_attention, reference
from agentkv.kernels.metadata import AttnMetadata
from agentkv.model.config import ModelConfig
from agentkv.model.default import random_init
from agentkv.model.llama import Transformer


def _pool(num_q: int, cached: int, heads: tuple[int, int], head_dim: int, page_size: int, dtype, seed: int):
    """q for a chunk of num_q after `cached` keys, and K/V pages of the whole
    sequence scattered over a pool twice its size (head-major, as the engine's)."""
    g = torch.Generator().manual_seed(seed)
    seq_len = cached + num_q
    pages = -(-seq_len // page_size)
    order = torch.randperm(2 * pages, generator=g)[:pages].tolist()
    hq, hkv = heads
    k_cache = torch.randn(hkv, 2 * pages, page_size, head_dim, generator=g).to(dtype).permute(1, 2, 0, 3)
    v_cache = torch.randn(hkv, 2 * pages, page_size, head_dim, generator=g).to(dtype).permute(1, 2, 0, 3)
    q = torch.randn(num_q, hq, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, AttnMetadata.build([num_q], [seq_len], [order], page_size)


def causal_flops(num_q: int, cached: int, heads: int, head_dim: int) -> float:
    pairs = num_q * cached + num_q * (num_q + 1) / 2
    return 4.0 * heads * head_dim * pairs


def attention_rows(args, bar) -> list[dict]:
    cfg = ModelConfig.from_hf(SHAPES[args.shape])
    heads = (cfg.num_heads, cfg.num_kv_heads)
    head_dim = cfg.head_dim
    scale = head_dim**-0.5
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for threads in args.thread_list:
            torch.set_num_threads(threads)
            for num_q, cached in args.shape_list:
                q, k_cache, v_cache, meta = _pool(num_q, cached, heads, head_dim, args.page_size, dtype, args.seed)
                out = torch.empty_like(q)
                runs = {
                    "kernel": lambda: cpu_chunk_attention.chunk_attention_into(out, q, k_cache, v_cache, meta, scale),
                    "reference": lambda: reference.paged_attention_into(out, q, k_cache, v_cache, meta, scale),
                }
                times: dict[str, list[float]] = {name: [] for name in runs}
                for f in runs.values():
                    f()  # first calls build and set up
                for _ in range(args.repeats):
                    for name, f in runs.items():
                        t = time.perf_counter()
                        f()
                        times[name].append(time.perf_counter() - t)
                    bar.update()
                flops = causal_flops(num_q, cached, heads[0], head_dim)
                row = {"dtype": dtype_name, "threads": threads, "chunk": num_q, "cached": cached}
                for name in runs:
                    ms = median(times[name]) * 1e3
                    row[f"{name}_ms"] = ms
                    row[f"{name}_gflops"] = flops / ms / 1e6
                row["speedup"] = row["reference_ms"] / row["kernel_ms"]
                rows.append(row)
    return rows


@contextlib.contextmanager
def chunk_kernel(on: bool):
    """The chunk kernel available or not for the forwards inside (the
    extension's error stands for a failed build; kernels.dispatch.select follows it)."""
    saved = cpu_chunk_attention.extension.error
    if not on:
        cpu_chunk_attention.extension.error = "off for the baseline of experiments.benchmarks.bench_chunk_attention"
    try:
        yield
    finally:
        cpu_chunk_attention.extension.error = saved


def prefill_rows(args, bar) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(args.seed)
    for dtype_name in args.dtypes.split(","):
        shape = dict(SHAPES[args.shape])
        shape["max_position_embeddings"] = max(shape["max_position_embeddings"], args.prefill_tokens + 16)
        model = Transformer(ModelConfig.from_hf(shape), getattr(torch, dtype_name))
        random_init(model, args.seed)
        # No prefix cache: each repeat computes the whole prompt again.
        engine = Engine(model, None, kv_cache_bytes=args.kv_gb << 30, prefix_cache=False)
        tokens = torch.randint(0, model.cfg.vocab_size, (args.prefill_tokens,), generator=gen).tolist()
        for threads in args.thread_list:
            torch.set_num_threads(threads)
            times: dict[bool, list[float]] = {True: [], False: []}
            session = engine.session()
            for _ in range(args.prefill_repeats):
                for on in (True, False):
                    with chunk_kernel(on):
                        t = time.perf_counter()
                        session.append(tokens)
                        times[on].append(time.perf_counter() - t)
                    session.truncate(0)
                    bar.update()
            session.close()
            new, old = median(times[True]), median(times[False])
            rows.append({"dtype": dtype_name, "threads": threads, "tokens": args.prefill_tokens,
                         "kernel_s": new, "reference_s": old, "kernel_tok_s": args.prefill_tokens / new,
                         "reference_tok_s": args.prefill_tokens / old, "speedup": old / new})
    return rows


DTYPE_LABEL = {"float32": "fp32", "bfloat16": "bf16"}


def plot(res: dict, path) -> None:
    plt = pyplot()
    rows = res["attention"]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    labels = [f"{DTYPE_LABEL[r['dtype']]} {r['threads']}t\n{r['chunk']}@{r['cached']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["reference_gflops"] for r in rows], 0.4, label="reference (torch)")
    ax.bar([i + 0.2 for i in x], [r["kernel_gflops"] for r in rows], 0.4, label="chunk kernel (C++)")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("GFLOP/s (causal work)")
    ax.set_title(f"prompt-chunk attention, {res['args']['shape']} heads (chunk@cached keys)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES))
    p.add_argument("--shapes", default="512x0,512x8192,512x16384,2048x0", help="CHUNKxCACHED, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--prefill-repeats", type=int, default=2)
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--kv-gb", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not cpu_chunk_attention.available():
        raise SystemExit(f"the chunk kernel did not build: {cpu_chunk_attention.build_error()}")
    args.shape_list = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    args.thread_list = [int(t) for t in args.threads.split(",")]
    out = run_dir("bench_chunk_attention", args.out)
    combos = len(args.dtypes.split(",")) * len(args.thread_list)
    total = combos * (len(args.shape_list) * args.repeats + (0 if args.skip_prefill else 2 * args.prefill_repeats))
    with tqdm(total=total, desc="chunk attention") as bar:
        attention = attention_rows(args, bar)
        prefill = [] if args.skip_prefill else prefill_rows(args, bar)
    config = {k: v for k, v in vars(args).items() if k not in ("shape_list", "thread_list")}
    res = {"args": config, "machine": machine(), "attention": attention, "prefill": prefill}
    text = table(
        ["dtype", "threads", "chunk", "cached", "reference ms", "kernel ms", "reference GFLOP/s", "kernel GFLOP/s",
         "speedup"],
        [[r["dtype"], r["threads"], r["chunk"], r["cached"], r["reference_ms"], r["kernel_ms"], r["reference_gflops"],
          r["kernel_gflops"], f"{r['speedup']:.2f}x"] for r in attention],
    )
    if prefill:
        text += "\n\n" + table(
            ["dtype", "threads", "prefill tokens", "reference s", "kernel s", "reference tok/s", "kernel tok/s",
             "speedup"],
            [[r["dtype"], r["threads"], r["tokens"], r["reference_s"], r["kernel_s"], r["reference_tok_s"],
              r["kernel_tok_s"], f"{r['speedup']:.2f}x"] for r in prefill],
        )
    summary = {f"attention_speedup_{r['dtype']}_{r['threads']}t_{r['chunk']}x{r['cached']}": r["speedup"]
               for r in attention}
    summary.update({f"prefill_speedup_{r['dtype']}_{r['threads']}t": r["speedup"] for r in prefill})
    wandb = WandbRun("bench_chunk_attention", config, summary,
                     tables={"attention": (list(attention[0]), [list(r.values()) for r in attention])})
    publish(out, res, text, plots={"chunk_attention.png": plot}, wandb=wandb)


if __name__ == "__main__":
    main()
