"""What bringing a session's KV back costs against computing it again.

A session of n tokens leaves the pool (Session.park: its KV goes to the
second tier, cache.kv_tier; the prefix cache is then emptied so nothing
else can supply it). Its next request, one more token, then either
restores the n tokens' KV from the tier and computes one, or (no tier)
computes all n + 1. Measured side by side, alternating, medians of
--repeats: recompute; restore from host memory at the pool's dtype
(bit-exact); from host memory as int8; from disk (the entry pushed out of
host memory by another session's, then read back and verified).

    python -m agentkv.experiments.benchmarks.bench_restore [--lengths 1024,4096,16000] [--shape default|smollm2-135m] [--repeats 3]
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from agentkv import Engine
from agentkv.experiments.common import machine, median, random_model, run_dir
from agentkv.experiments.report import WandbRun, publish, pyplot, save_figure, table

MODES = ("recompute", "host", "host-int8", "disk")


def make_engine(base: Engine, mode: str, pages: int, n: int, spill: Path) -> Engine:
    entry = (n + 64) * base.pool.token_bytes
    kwargs = dict(page_size=base.pool.page_size, num_pages=pages, prefix_cache=True)
    if mode == "recompute":
        return Engine(base.model, None, kv_offload_bytes=0, **kwargs)
    if mode == "disk":  # room for one entry: a second pushes the first to disk
        return Engine(base.model, None, kv_offload_bytes=int(1.5 * entry), kv_offload_dir=spill, **kwargs)
    return Engine(base.model, None, kv_offload_bytes=4 * entry, kv_offload_codec="int8" if mode == "host-int8" else "pool",
                  **kwargs)


def one(base: Engine, mode: str, ids: list[int], pages: int, spill: Path) -> dict:
    """Seconds of the request that brings the session back (one new token)."""
    engine = make_engine(base, mode, pages, len(ids), spill)
    with engine.session() as warm:  # first forwards on a new pool pay one-off set-up costs
        warm.append(ids[:0:-1][:64])
        warm.append([ids[0]])
    engine.scheduler.make_room(engine.pool.num_pages)
    with engine.session() as s:
        s.append(ids)
        s.park()
        if mode == "disk":
            with engine.session() as other:
                other.append(ids[::-1])
                other.park()
        engine.scheduler.make_room(engine.pool.num_pages)  # empty the prefix cache too
        start = time.perf_counter()
        s.append([ids[0]])
        seconds = time.perf_counter() - start
    tier = engine.tier
    return {"seconds": seconds, "restored": tier.counters.restored_tokens if tier else 0,
            "restore_s": tier.counters.restore_s if tier else 0.0,
            "bytes": tier.counters.restore_bytes if tier else 0}


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    base = Engine.from_pretrained() if args.shape == "default" else Engine(random_model(args.shape, torch.float32),
                                                                            None)
    vocab, limit = base.model.cfg.vocab_size, base.max_context - 1
    lengths = [min(n, limit) for n in args.lengths]
    rng = random.Random(args.seed)
    results = {"machine": machine(), "shape": args.shape, "token_bytes": base.pool.token_bytes, "rows": []}
    with tempfile.TemporaryDirectory() as spill:
        for n in lengths:
            ids = [rng.randrange(vocab) for _ in range(n)]
            pages = -(-(2 * n + 64) // base.pool.page_size)
            samples = {m: [] for m in MODES}
            for _ in tqdm(range(args.repeats), desc=f"{n} tokens", unit="repeat"):
                for mode in MODES:  # alternating: a noisy spell falls on every mode alike
                    samples[mode].append(one(base, mode, ids, pages, Path(spill) / mode))
            row = {"tokens": n}
            for mode in MODES:
                row[f"{mode}_s"] = median([x["seconds"] for x in samples[mode]])
                if mode != "recompute":
                    row[f"{mode}_restored"] = samples[mode][0]["restored"]
                    row[f"{mode}_restore_only_s"] = median([x["restore_s"] for x in samples[mode]])
            results["rows"].append(row)
    return results


def report(res: dict) -> str:
    rows = []
    for r in res["rows"]:
        rec = r["recompute_s"]
        rows.append([r["tokens"], rec * 1e3] + [x for m in MODES[1:] for x in
                    (r[f"{m}_s"] * 1e3, f"{rec / r[f'{m}_s']:.1f}x", r[f"{m}_restored"])])
    heads = ["tokens", "recompute ms"] + [h for m in MODES[1:] for h in (f"{m} ms", f"{m} vs recompute", f"{m} restored")]
    return (f"KV of {res['token_bytes']} bytes a token ({res['shape']} model, fp32); the request that brings a "
            f"session of n tokens back with one new token\n" + table(heads, rows))


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["tokens"] for r in res["rows"]]
    for m in MODES:
        ax.plot(xs, [r[f"{m}_s"] * 1e3 for r in res["rows"]], marker="o", label=m)
    ax.set(xscale="log", yscale="log", xlabel="session tokens", ylabel="ms to bring the session back",
           title="restore from the KV tiers vs recompute")
    ax.legend()
    save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 16000])
    p.add_argument("--shape", default="default", help="default (the embedded model) or a random-init shape")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    res = run(args)
    out = run_dir("bench_restore", args.out)
    summary = {f"speedup_{m}_{r['tokens']}": r["recompute_s"] / r[f"{m}_s"] for r in res["rows"] for m in MODES[1:]}
    publish(out, res, report(res), {"restore.png": plot},
            WandbRun("bench_restore", vars(args), summary, tables={"rows": (list(res["rows"][0]), [list(r.values()) for r in res["rows"]])}))
    return res


if __name__ == "__main__":
    main()
