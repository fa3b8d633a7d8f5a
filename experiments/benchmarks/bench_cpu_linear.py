"""CPU linears on thin and prefill-sized inputs: oneDNN with packed weights
(model/packed_linear.py) against the weight-streaming C++ kernel
(kernels/cpu_linear.py), as ms per call and GB/s of weights read, next to a
plain memory read measured in the same run.

Shapes are the linears our models run (q/k/v and gate/up fused): the
SmolLM2-135M shape's and the embedded models/agent-8m's. Each case cycles
through enough copies of its weight (>= --stream-mb) that every call reads its
weight from memory, as a model's step does, not from the caches. Paths
alternate within each repeat; medians of --repeats.

    python -m agentkv.experiments.benchmarks.bench_cpu_linear [--rows 1,2,4,8,16,32,256,512] [--threads 1,2]
        [--dtypes bfloat16,float32] [--repeats 7] [--stream-mb 96]

Writes runs/bench_cpu_linear-<time>/{results.json, report.txt, bench_cpu_linear.png}.
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from agentkv.experiments.benchmarks.bench_cpu_attention import read_bandwidth
from agentkv.experiments.common import SHAPES, machine, median, run_dir
from agentkv.experiments.report import publish, pyplot, save_figure, table
from agentkv.kernels import cpu_linear
from agentkv.model import packed_linear


def model_shapes(name: str, hf: dict) -> list[tuple[str, int, int, int]]:
    """(label, in, out, per step) of a model's linears; per step: how many a
    decode step runs."""
    hidden, inter, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim", hidden // hf["num_attention_heads"])
    q, kv = hf["num_attention_heads"] * head_dim, hf["num_key_value_heads"] * head_dim
    return [
        (f"{name} qkv", hidden, q + 2 * kv, layers),
        (f"{name} o", q, hidden, layers),
        (f"{name} gate_up", hidden, 2 * inter, layers),
        (f"{name} down", inter, hidden, layers),
        (f"{name} lm_head", hidden, hf["vocab_size"], 1),
    ]


AGENT_8M = dict(hidden_size=384, intermediate_size=704, num_hidden_layers=5, num_attention_heads=6,
                num_key_value_heads=2, head_dim=64, vocab_size=4096)  # models/agent-8m/config.json

PATHS = ("onednn", "cpp")


def time_case(dtype: torch.dtype, n_in: int, n_out: int, rows: int, args, gen: torch.Generator) -> dict:
    w = torch.randn(n_in, n_out, generator=gen).to(dtype)
    copies = max(1, -(-args.stream_mb * 2**20 // w.nbytes))
    if rows > 32:  # compute-bound: the caches no longer matter, fewer copies keep it short
        copies = min(copies, 2)
    weights = [w.clone() for _ in range(copies)]
    packed = {
        "onednn": [packed_linear.pack(c) for c in weights],
        "cpp": [cpu_linear.pack(c) for c in weights],
    }
    run = {"onednn": packed_linear.packed_linear, "cpp": cpu_linear.linear}
    x = torch.randn(rows, n_in, generator=gen).to(dtype)
    times = {p: [] for p in PATHS}
    for p in PATHS:  # warm-up
        for c in packed[p]:
            run[p](x, c, None)
    for _ in range(args.repeats):
        for p in PATHS:
            t = time.perf_counter()
            for c in packed[p]:
                run[p](x, c, None)
            times[p].append((time.perf_counter() - t) / copies)
    return {p: median(times[p]) for p in PATHS}


def plot(results: dict, path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, dtype in zip(axes, ("bfloat16", "float32")):
        for model in results["args"]["models"].split(","):
            for threads, style in ((1, "-"), (2, "--")):
                step = [r for r in results["step"]
                        if r["model"] == model and r["dtype"] == dtype and r["threads"] == threads]
                if step:
                    ax.plot([r["rows"] for r in step], [r["onednn_ms"] / r["cpp_ms"] for r in step], style,
                            marker="o", label=f"{model}, {threads} thread(s)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows (T)")
        ax.set_title(f"{dtype}: oneDNN time / kernel time, all linears of a step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    axes[0].set_ylabel("speed-up of the kernel")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,256,512")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--models", default="smollm2-135m,agent-8m")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--stream-mb", type=int, default=96, help="weights cycled per case, to defeat the caches")
    args = p.parse_args(argv)
    row_counts = [int(r) for r in args.rows.split(",")]
    threads_list = [int(t) for t in args.threads.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    missing = [d for d in dtypes if d not in cpu_linear.dtypes()]
    if missing:
        raise SystemExit(f"the C++ kernel does not run {missing} here: {cpu_linear.build_error()}")
    shapes = []
    for name in args.models.split(","):
        shapes += model_shapes(name, AGENT_8M if name == "agent-8m" else SHAPES[name])
    gen = torch.Generator().manual_seed(0)
    out = run_dir("bench_cpu_linear")
    rows, bandwidth = [], {}
    cases = [(d, n, s, t) for d in dtypes for n in threads_list for s in shapes for t in row_counts
             if not (s[0].endswith("lm_head") and t > 32)]  # a prefill chunk projects only its last rows
    for dtype, threads, (label, n_in, n_out, per_step), t in tqdm(cases, desc="linears"):
        torch.set_num_threads(threads)
        if threads not in bandwidth:
            bandwidth[threads] = read_bandwidth(args.repeats)
        ms = time_case(dtype, n_in, n_out, t, args, gen)
        nbytes = n_in * n_out * dtype.itemsize
        rows.append({"dtype": str(dtype).removeprefix("torch."), "threads": threads, "linear": label, "in": n_in,
                     "out": n_out, "per_step": per_step, "rows": t, "weight_MB": nbytes / 1e6,
                     "read_GBps": bandwidth[threads],
                     **{f"{p}_ms": ms[p] * 1e3 for p in PATHS}, **{f"{p}_GBps": nbytes / ms[p] / 1e9 for p in PATHS}})
    # All linears of one step of each model: the per-step sum over its shapes
    # (lm_head only up to 32 rows, as above).
    step = []
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            for threads in threads_list:
                for t in row_counts:
                    part = [r for r in rows if r["linear"].startswith(model + " ") and r["dtype"] == dtype
                            and r["threads"] == threads and r["rows"] == t]
                    mb = sum(r["weight_MB"] * r["per_step"] for r in part)
                    s = {"model": model, "dtype": dtype, "threads": threads, "rows": t, "weight_MB": mb,
                         "read_GBps": bandwidth[threads]}
                    for p in PATHS:
                        s[f"{p}_ms"] = sum(r[f"{p}_ms"] * r["per_step"] for r in part)
                        s[f"{p}_GBps"] = mb / s[f"{p}_ms"]
                    step.append(s)
    text = table(
        ["dtype", "threads", "linear", "T", "MB", "oneDNN ms", "oneDNN GB/s", "cpp ms", "cpp GB/s", "oneDNN/cpp",
         "cpp/read"],
        [[r["dtype"], r["threads"], r["linear"], r["rows"], r["weight_MB"], r["onednn_ms"], r["onednn_GBps"],
          r["cpp_ms"], r["cpp_GBps"], f"{r['onednn_ms'] / r['cpp_ms']:.2f}", f"{r['cpp_GBps'] / r['read_GBps']:.2f}"]
         for r in rows],
    )
    text += "\n\nall linears of one step (lm_head only for T <= 32)\n" + table(
        ["model", "dtype", "threads", "T", "MB", "read GB/s", "oneDNN ms", "oneDNN GB/s", "cpp ms", "cpp GB/s",
         "oneDNN/cpp"],
        [[s["model"], s["dtype"], s["threads"], s["rows"], s["weight_MB"], s["read_GBps"], s["onednn_ms"],
          s["onednn_GBps"], s["cpp_ms"], s["cpp_GBps"], f"{s['onednn_ms'] / s['cpp_ms']:.2f}"] for s in step],
    )
    results = {"args": vars(args), "machine": machine(), "read_GBps": bandwidth, "rows": rows, "step": step}
    publish(out, results, text, {"bench_cpu_linear.png": plot})
    return results


if __name__ == "__main__":
    main()
