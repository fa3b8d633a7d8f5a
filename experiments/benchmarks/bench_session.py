"""Stateful vs stateless turns on one engine, side by side in one run.

A 12-turn conversation: a shared prefix (system prompt and tool schemas) of
about 1,200 tokens, then each turn about 150 new tokens and 40 generated ones,
on a random-init model of SmolLM2-135M's shape. The stateful session computes
only each turn's delta; the stateless baseline re-prefills the whole history
every turn. Turns alternate between the two so both see the same machine noise.

    python -m agentkv.experiments.benchmarks.bench_session [--shape smollm2-135m] [--dtype float32] [--repeats 3]
"""
from __future__ import annotations

import argparse
import random

import torch
from tqdm import tqdm

from agentkv import Engine
from agentkv.experiments.common import machine, median, random_model, run_dir
from agentkv.experiments.report import pyplot, save_figure, table, write_json


def timed_turn(engine: Engine, session, new: list[int], gen: int) -> tuple[float, float, int]:
    """(turn seconds, decode seconds per token, tokens computed)."""
    session.append(new)
    session.generate(max_tokens=gen, ignore_eos=True)
    st = engine.stats[-1]
    return st.total_s, st.decode_s / max(st.generated_tokens - 1, 1), st.computed_tokens


def run(args) -> dict:
    torch.manual_seed(0)
    model = random_model(args.shape, getattr(torch, args.dtype), device=args.device)
    vocab = model.cfg.vocab_size
    engine = Engine(model, None, page_size=args.page_size, kv_cache_bytes=args.kv_gb << 30)
    # Its own engine, without a prefix cache: nothing the stateful side
    # computed can be found again.
    stateless = Engine(model, None, page_size=args.page_size, kv_cache_bytes=args.kv_gb << 30, stateless=True)
    rng = random.Random(args.seed)
    deltas = [[rng.randrange(vocab) for _ in range(args.new)] for _ in range(args.turns)]
    deltas[0] = [rng.randrange(vocab) for _ in range(args.prefix)] + deltas[0]
    results = {"stateful": [[] for _ in range(args.turns)], "stateless": [[] for _ in range(args.turns)]}
    decode = {"stateful": [], "stateless": []}
    prompt_lens = []
    computed: list[tuple[int, int]] = [(0, 0)] * args.turns
    # Warm-up: one short turn of each so first-call costs are not in turn 1.
    with engine.session() as w:
        timed_turn(engine, w, deltas[0][:64], 4)
    bar = tqdm(total=args.repeats * args.turns, desc="turns")
    for _ in range(args.repeats):
        stateful = engine.session()
        history: list[int] = []
        prompt_lens.clear()
        for t in range(args.turns):
            history_before = list(history)
            s_time, s_dec, s_computed = timed_turn(engine, stateful, deltas[t], args.gen)
            history = stateful.tokens
            prompt_lens.append(len(history_before) + len(deltas[t]))
            with stateless.session() as fresh:
                f_time, f_dec, f_computed = timed_turn(stateless, fresh, history_before + deltas[t], args.gen)
            computed[t] = (s_computed, f_computed)
            results["stateful"][t].append(s_time)
            results["stateless"][t].append(f_time)
            decode["stateful"].append(s_dec)
            decode["stateless"].append(f_dec)
            bar.update()
        stateful.close()
    bar.close()
    rows = []
    for t in range(args.turns):
        sf, sl = median(results["stateful"][t]), median(results["stateless"][t])
        rows.append([t + 1, prompt_lens[t], *computed[t], sf * 1e3, sl * 1e3, sl / sf])
    keys = ["turn", "prompt", "computed", "stateless_computed", "stateful_ms", "stateless_ms", "speedup"]
    return {
        "args": vars(args),
        "machine": machine(),
        "turns": [dict(zip(keys, r)) for r in rows],
        "decode_ms_per_token": {k: median(v) * 1e3 for k, v in decode.items()},
        "end_to_end_s": {k: sum(median(x) for x in v) for k, v in results.items()},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--prefix", type=int, default=1200)
    p.add_argument("--new", type=int, default=150)
    p.add_argument("--gen", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-gb", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = run_dir("bench_session")
    res = run(args)
    rows = [[r["turn"], r["prompt"], r["computed"], r["stateless_computed"], r["stateful_ms"], r["stateless_ms"],
             f"{r['speedup']:.2f}x"] for r in res["turns"]]
    print(table(["turn", "prompt", "computed", "stateless computed", "stateful ms", "stateless ms", "speed-up"], rows))
    speedups = [r["speedup"] for r in res["turns"]]
    print(f"median speed-up {median(speedups):.2f}x; end to end: stateful {res['end_to_end_s']['stateful']:.1f} s, "
          f"stateless {res['end_to_end_s']['stateless']:.1f} s; decode ms/token: "
          f"{res['decode_ms_per_token']['stateful']:.1f} (stateful), {res['decode_ms_per_token']['stateless']:.1f} (stateless)")
    write_json(out / "results.json", res)
    plot(res, out / "per_turn.png")
    print(f"wrote {out}/results.json and per_turn.png")


def plot(res: dict, path) -> None:
    plt = pyplot()
    turns = [r["turn"] for r in res["turns"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(turns, [r["stateful_ms"] for r in res["turns"]], "o-", label="stateful (computes Δ)")
    ax.plot(turns, [r["stateless_ms"] for r in res["turns"]], "s-", label="stateless (re-prefills n)")
    ax.set_xlabel("turn")
    ax.set_ylabel("turn latency (ms)")
    ax.set_title(f"{res['args']['shape']} {res['args']['dtype']}, median of {res['args']['repeats']}")
    ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
