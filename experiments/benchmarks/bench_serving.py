"""The serving core under load: many clients against a KV pool smaller than
their working set, and what batching buys.

Part 1, over HTTP: N clients (the real openai client, one thread each) run
multi-turn conversations with session ids against this server, whose KV pool
holds a given fraction of their working set. Every reply is greedy with a
fixed length, so the same conversations served one at a time on a server
with room to spare are the reference. Reported: HTTP errors by status,
completed requests, replies equal to the reference, preemptions, queue time,
KV usage and prefix-cache hit rate (the server's own /metrics).

Part 2, in-process: aggregate decode throughput of B sessions decoding
together against one session alone (random weights of a named shape), and
the scheduler's host overhead per decode step (step wall time minus the
forward's) at each batch size.

    python -m agentkv.experiments.benchmarks.bench_serving [--clients 16] [--kv-fraction 0.5] [--batches 1,2,4,8] [--threads 1]
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from agentkv import Engine
from agentkv.engine.limits import Limits
from agentkv.experiments.common import machine, random_model, run_dir
from agentkv.experiments.drivers.servers import InProcessServer
from agentkv.experiments.report import WandbRun, log_wandb, pyplot, save_figure, table, write_json

SYSTEM = "You are agent {i}, one of a team of coding agents. Work carefully and report what you find."
ASKS = ["Summarise what module {m} does.", "Which functions in {m} touch the cache?", "Propose one test for {m}.",
        "What would break if {m} were removed?", "Write a one-line docstring for {m}."]


def conversation(i: int, turns: int) -> list[str]:
    """Client i's user messages: distinct from every other client's from the first token on."""
    module = f"pkg/agent_{i}/mod_{(i * 7919) % 1000}.py"
    return [ASKS[(i + t) % len(ASKS)].format(m=module) + f" (step {t + 1} of agent {i})" for t in range(turns)]


def run_client(base_url: str, model: str, i: int, turns: int, gen: int, progress) -> dict:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    messages = [{"role": "system", "content": SYSTEM.format(i=i)}]
    replies, errors, latencies = [], [], []
    for ask in conversation(i, turns):
        messages.append({"role": "user", "content": ask})
        start = time.perf_counter()
        try:
            r = client.chat.completions.create(model=model, messages=messages, max_tokens=gen, temperature=0.0,
                                               extra_body={"session_id": f"agent-{i}", "ignore_eos": True})
        except openai.APIStatusError as e:
            errors.append(e.status_code)
            break
        except openai.APIError as e:
            errors.append(type(e).__name__)
            break
        finally:
            progress.update(1)
        latencies.append(time.perf_counter() - start)
        reply = r.choices[0].message.content or ""
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
    return {"replies": replies, "errors": errors, "latencies": latencies}


def working_set_tokens(engine: Engine, clients: int, turns: int, gen: int) -> int:
    """Tokens all clients' sessions hold at the end: each one's rendered history plus its last reply."""
    tok = engine.tokenizer
    total = 0
    for i in range(clients):
        messages = [{"role": "system", "content": SYSTEM.format(i=i)}]
        for ask in conversation(i, turns):
            messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": "x " * gen}]
        total += len(tok.apply_chat_template(messages[:-1])) + gen
    return total


def serve_clients(model_dir: Path | None, clients: int, turns: int, gen: int, pages: int | None, parallel: bool,
                  label: str) -> dict:
    engine = Engine.from_pretrained(model_dir, num_pages=pages) if pages else Engine.from_pretrained(model_dir)
    server = InProcessServer(engine, "agentkv-bench")
    bar = tqdm(total=clients * turns, desc=label)
    start = time.perf_counter()
    try:
        if parallel:
            with ThreadPoolExecutor(clients) as pool:
                results = list(pool.map(lambda i: run_client(server.base_url, "agentkv-bench", i, turns, gen, bar),
                                        range(clients)))
        else:
            results = [run_client(server.base_url, "agentkv-bench", i, turns, gen, bar) for i in range(clients)]
        wall = time.perf_counter() - start
        metrics = server.metrics()
    finally:
        bar.close()
        server.stop()
    return {"results": results, "wall_s": wall, "metrics": metrics, "pages": engine.pool.num_pages,
            "page_size": engine.pool.page_size}


def part1(args) -> dict:
    probe = Engine.from_pretrained(None, num_pages=1)
    need = working_set_tokens(probe, args.clients, args.turns, args.gen)
    ps = probe.pool.page_size
    pages = max(1, int(need * args.kv_fraction) // ps)
    alone = serve_clients(None, args.clients, args.turns, args.gen, None, False, "one at a time")
    loaded = serve_clients(None, args.clients, args.turns, args.gen, pages, True, f"{args.clients} at once")
    ref = [r["replies"] for r in alone["results"]]
    got = [r["replies"] for r in loaded["results"]]
    statuses = [e for r in loaded["results"] for e in r["errors"]]
    m = loaded["metrics"]
    lat = sorted(x for r in loaded["results"] for x in r["latencies"])
    return {
        "working_set_tokens": need, "pool_tokens": pages * ps, "kv_fraction": args.kv_fraction,
        "requests": args.clients * args.turns,
        "completed": sum(len(r["replies"]) for r in loaded["results"]),
        "errors": statuses, "errors_5xx": sum(1 for s in statuses if isinstance(s, int) and s >= 500),
        "equal_to_one_at_a_time": sum(a == b for ra, rb in zip(ref, got) for a, b in zip(ra, rb)),
        "conversations_equal": sum(ra == rb for ra, rb in zip(ref, got)),
        "preemptions": m.get("vllm:num_preemptions_total", 0),
        "prefix_hit_rate": m.get("vllm:prefix_cache_hits_total", 0) / max(m.get("vllm:prefix_cache_queries_total", 1), 1),
        "queue_s_mean": m.get("vllm:request_queue_time_seconds_sum", 0) / max(m.get("vllm:request_queue_time_seconds_count", 1), 1),
        "latency_p50_s": lat[len(lat) // 2] if lat else None, "latency_p90_s": lat[int(len(lat) * 0.9)] if lat else None,
        "wall_s": loaded["wall_s"], "wall_one_at_a_time_s": alone["wall_s"],
    }


def part2(args) -> dict:
    model = random_model(args.shape, getattr(torch, args.dtype))
    vocab = model.cfg.vocab_size
    out = {}
    for b in tqdm([int(x) for x in args.batches.split(",")], desc="batch sizes"):
        engine = Engine(model, None, page_size=16, kv_cache_bytes=1 << 30,
                        limits=Limits(max_num_batched_tokens=max(2048, b * args.prompt)))
        g = torch.Generator().manual_seed(b)
        sessions = [engine.session() for _ in range(b)]
        for s in sessions:
            s.append(torch.randint(0, vocab, (args.prompt,), generator=g).tolist())
        # Warm-up decode, then measure decode only (every step holds all B).
        reqs = [s.start_generate(max_tokens=2, ignore_eos=True, speculative=False) for s in sessions]
        for r in reqs:
            engine.scheduler.wait(r)
        c = engine.scheduler.counters
        steps0, step0, fwd0 = c.steps, c.step_s, c.forward_s
        start = time.perf_counter()
        reqs = [s.start_generate(max_tokens=args.decode, ignore_eos=True, speculative=False) for s in sessions]
        for r in reqs:
            engine.scheduler.wait(r)
        wall = time.perf_counter() - start
        steps, step_s, fwd_s = c.steps - steps0, c.step_s - step0, c.forward_s - fwd0
        out[b] = {"tokens_per_s": b * args.decode / wall, "step_ms": 1000 * step_s / steps,
                  "forward_ms": 1000 * fwd_s / steps, "host_overhead_frac": (step_s - fwd_s) / step_s,
                  "steps": steps}
        for s in sessions:
            s.close()
    base = out[min(out)]["tokens_per_s"]
    for r in out.values():
        r["speedup_vs_one"] = r["tokens_per_s"] / base
    return out


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    p2 = res["part2"]
    bs = sorted(p2, key=int)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([int(b) for b in bs], [p2[b]["tokens_per_s"] for b in bs], marker="o")
    ax1.set_xlabel("sessions decoding together")
    ax1.set_ylabel("aggregate decode tokens/s")
    ax1.set_title(f"batching ({res['args']['shape']}, {res['args']['dtype']})")
    ax1.grid(alpha=0.3)
    ax2.bar([str(b) for b in bs], [100 * p2[b]["host_overhead_frac"] for b in bs])
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("host overhead, % of a decode step")
    ax2.axhline(10, color="red", linestyle="--", linewidth=1)
    p1 = res.get("part1")
    if p1:
        fig.suptitle(f"{res['args']['clients']} clients, pool {p1['pool_tokens']} of {p1['working_set_tokens']} "
                     f"working-set tokens: {p1['completed']}/{p1['requests']} done, {p1['errors_5xx']} 5xx, "
                     f"{p1['preemptions']:.0f} preemptions")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--gen", type=int, default=24, help="tokens per reply (greedy, ignore_eos)")
    p.add_argument("--kv-fraction", type=float, default=0.5, help="KV pool / the clients' working set")
    p.add_argument("--shape", default="smollm2-135m", help="part 2's model shape (random weights)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--prompt", type=int, default=256, help="part 2: each session's context before decoding")
    p.add_argument("--decode", type=int, default=32, help="part 2: tokens each session decodes")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--no-wandb", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = run_dir("bench_serving")
    res = {"args": vars(args), "machine": machine()}
    if not args.skip_http:
        res["part1"] = part1(args)
        p1 = res["part1"]
        print(f"\n{args.clients} clients x {args.turns} turns, KV pool {p1['pool_tokens']} tokens for a working set "
              f"of {p1['working_set_tokens']} ({args.kv_fraction:.0%}):")
        print(table(["completed", "5xx", "other errors", "replies = one-at-a-time", "preemptions", "prefix hit rate",
                     "queue s (mean)", "p50 s", "p90 s", "wall s", "one-at-a-time wall s"],
                    [[f"{p1['completed']}/{p1['requests']}", p1["errors_5xx"], len(p1["errors"]) - p1["errors_5xx"],
                      f"{p1['equal_to_one_at_a_time']}/{p1['completed']}", int(p1["preemptions"]),
                      f"{p1['prefix_hit_rate']:.2f}", p1["queue_s_mean"], p1["latency_p50_s"], p1["latency_p90_s"],
                      p1["wall_s"], p1["wall_one_at_a_time_s"]]]))
    res["part2"] = {str(k): v for k, v in part2(args).items()}
    print(f"\ndecode throughput, {args.shape} {args.dtype}, {args.prompt}-token contexts, {args.threads} thread(s):")
    print(table(["sessions", "tokens/s", "x one", "step ms", "forward ms", "host overhead %"],
                [[b, r["tokens_per_s"], f"{r['speedup_vs_one']:.2f}", r["step_ms"], r["forward_ms"],
                  f"{100 * r['host_overhead_frac']:.1f}"] for b, r in res["part2"].items()]))
    write_json(out / "results.json", res)
    plot(res, out / "bench_serving.png")
    if not args.no_wandb:
        rows = [[int(b), r["tokens_per_s"], r["speedup_vs_one"], r["host_overhead_frac"]] for b, r in res["part2"].items()]
        summary = {k: v for k, v in res.get("part1", {}).items() if isinstance(v, (int, float))}
        print(log_wandb(WandbRun("bench_serving", res["args"], summary,
                                 tables={"decode": (["batch", "tokens_per_s", "speedup", "host_overhead"], rows)}), out))
    print(f"wrote {out}/results.json and {out}/bench_serving.png")
    return res


if __name__ == "__main__":
    main()
