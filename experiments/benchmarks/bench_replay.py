"""The thesis, measured fairly: agents replaying externally written
trajectories (experiments.workloads.traces: BFCL v4's multi-turn
categories, AgentDojo's suites) against every system over HTTP, under KV
budgets that are fractions of the agents' distinct tokens, with seeded
tool pauses from a published statistic (experiments.workloads.replay_agents).

Every system gets the identical request stream (each agent's whole
history, greedy, exactly --max-tokens generated with ignore_eos; a digest
of every body is compared across systems and printed) and the same KV
tokens (whole --unit-token blocks; on a CPU our host tier would be the
same RAM, so there is none but in agentkv-int8tier, which splits the same
bytes). Systems, each its own server started fresh:

- agentkv: serve.py as shipped (a session per agent, tool-aware retention,
  program admission, native continuation, token-granular reuse), speculation
  off (--drafter none), as the headline's every system;
- the one-engine ablations: agentkv-lru (minus retention: idle KV by LRU,
  token-granular), agentkv-noadmit (minus program admission),
  agentkv-prefix (minus both: the engine as a plain LRU prefix cache),
  agentkv-int8tier (the same bytes split: a pool that holds the longest
  request, the rest a host tier of int8 KV),
  agentkv-block128 / agentkv-block16 (vLLM's prefix caching re-done on our
  engine: no sessions, whole blocks, LRU, no admission), agentkv-nonative
  (template-faithful continuation), agentkv-torch (the torch path instead of
  the C++ kernels), agentkv-spec (plus speculation: suffix drafts);
- vllm: vLLM's own OpenAI server (.venv-vllm) at its best: torch.compile on
  and warmed before any clock, both cores, TCMalloc and Intel OpenMP, prefix
  caching, --vllm-block-size (measure 32 against 128), the same step limits;
  vllm-spec: plus its ngram speculation.

The order of the systems rotates across --repeats; the report gives per
cell and system the medians over repeats with min-max, each system's job
p50 as a multiple of agentkv's (median of the per-repeat ratios),
recomputed tokens (computed less what no cache can avoid), preemptions,
the host and the command, a PNG and an offline wandb run. A replay measures
serving, not answers: the replies are discarded.

    python -m agentkv.experiments.benchmarks.bench_replay [--family bfcl-long] [--agents 8,16,32] \\
        [--fractions 0.25,0.5,1.0] [--systems agentkv,agentkv-lru,...,vllm] [--repeats 3] [--max-tokens 32] \\
        [--model DIR] [--dtype bfloat16] [--max-positions 65536]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from agentkv.engine import STALLS
from agentkv.experiments.benchmarks.bench_agents import (DTYPE_BYTES, delta, hf_checkpoint, kv_bytes_per_token,
                                                          model_config, timelines, vllm_kv_line, warm_up)
from agentkv.experiments.common import machine, median, parse_systems, run_dir
from agentkv.experiments.drivers.checkpoint import with_positions
from agentkv.experiments.drivers.servers import ServerProcess, start_engine_server
from agentkv.experiments.drivers.system import ROOT, rel
from agentkv.experiments.drivers.vllm import start_vllm_server, vllm_status
from agentkv.experiments.report import WandbRun, publish, pyplot, save_figure, table, write_json
from agentkv.experiments.workloads.agent_runs import records_json, run_all, summarize
from agentkv.experiments.workloads.replay_agents import PAUSE_SOURCE, Sent, TracePauses, openai_send, replay_job
from agentkv.experiments.workloads.replay_budget import budget_tokens, render_prompts, replay_footprint
from agentkv.experiments.workloads.traces import Trace, stream_digest
from agentkv.model.loader import cpu_has_bf16_dot, load_tokenizer

BLOCK_HASH = ("--prefix-match", "block", "--kv-retention", "lru", "--no-program-admission")
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


@dataclass(frozen=True)
class System:
    name: str
    flags: tuple[str, ...] = ()  # serve.py's, or vLLM's server's
    sessions: bool = True  # each agent's requests carry its X-Session-Id
    env: dict = field(default_factory=dict)
    vllm: bool = False
    # The budget's bytes split: the pool holds the longest request (a step
    # computes in the pool), the rest is a host tier of int8 KV, about twice
    # the tokens in the same bytes (on a CPU the tier is the same RAM).
    int8_tier: bool = False


SYSTEMS = {s.name: s for s in (
    System("agentkv", ("--drafter", "none")),  # serve.py as shipped, speculation off
    System("agentkv-lru", ("--kv-retention", "lru", "--drafter", "none")),
    System("agentkv-noadmit", ("--no-program-admission", "--drafter", "none")),
    # Minus retention and admission: the engine as a plain LRU prefix cache, token-granular, with sessions.
    System("agentkv-prefix", ("--kv-retention", "lru", "--no-program-admission", "--drafter", "none")),
    System("agentkv-block128", BLOCK_HASH + ("--page-size", "128", "--drafter", "none"), sessions=False),
    System("agentkv-block16", BLOCK_HASH + ("--page-size", "16", "--drafter", "none"), sessions=False),
    System("agentkv-nonative", ("--continuation", "template-faithful", "--drafter", "none")),
    System("agentkv-torch", ("--drafter", "none"), env={"AGENTKV_KERNELS": "torch"}),
    System("agentkv-spec", ("--drafter", "suffix")),
    System("agentkv-int8tier", ("--drafter", "none", "--kv-offload-codec", "int8"), int8_tier=True),
    System("vllm", sessions=False, vllm=True),
    System("vllm-spec", ("--speculative-config", NGRAM), sessions=False, vllm=True),
)}
DEFAULT_SYSTEMS = ("agentkv", "agentkv-lru", "agentkv-noadmit", "agentkv-block128", "agentkv-block16",
                   "agentkv-nonative", "agentkv-spec", "vllm")
FAMILIES = ("bfcl-base", "bfcl-long", "agentdojo-workspace")
UNIT = 128  # budgets in whole 128-token blocks: our 16- and 128-token pages and vLLM's 32 or 128 all fit


def build_traces(family: str, n: int, seed: int, user_turns: int, roles: str | None) -> list[Trace]:
    if family.startswith("bfcl-"):
        from agentkv.experiments.workloads.bfcl_agents import DEFAULT_ROLES
        from agentkv.experiments.workloads.bfcl_traces import bfcl_traces

        return bfcl_traces(family, n, seed, tuple(roles.split(",")) if roles else DEFAULT_ROLES)
    if family.startswith("agentdojo-"):
        from agentkv.experiments.workloads.agentdojo_traces import agentdojo_traces

        return agentdojo_traces(n, seed, suites=(family.removeprefix("agentdojo-"),), user_turns=user_turns)
    raise ValueError(f"unknown family {family!r}: one of {FAMILIES}")


def rotation(systems: list[str], repeat: int) -> list[str]:
    """The systems' order in a repeat: each repeat starts one further along."""
    k = repeat % len(systems)
    return systems[k:] + systems[:k]


def start_server(system: System, args: argparse.Namespace, cell: dict, log: Path) -> ServerProcess:
    tokens, token_bytes = cell["budget_tokens"], cell["token_bytes"]
    if system.vllm:
        block = args.vllm_block_size
        blocks = tokens // block
        # vLLM holds one block back for good (its null block): one more leaves `blocks` usable.
        kv_gb = math.ceil((blocks + 1) * block * token_bytes / 2**30)
        extra = ["--block-size", str(block), "--num-gpu-blocks-override", str(blocks + 1),
                 "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs",
                 str(args.max_num_seqs), "--seed", "0", *system.flags]
        return start_vllm_server(args.model, threads=args.threads, dtype=args.dtype, kv_gb=kv_gb,
                                 max_model_len=cell["max_model_len"], served_model_name="bench", extra_args=extra,
                                 log=log)
    pool = tokens
    if system.int8_tier:
        pool = min(tokens, -(-(cell["longest_request_tokens"] + args.max_tokens) // UNIT) * UNIT)
    # bytes / 2**30 is exact in binary floating point: serve.py's int(gb * 2**30) gets the bytes back.
    flags = ["--dtype", args.dtype, "--kv-cache-gb", repr(pool * token_bytes / 2**30),
             "--kv-offload-gb", repr((tokens - pool) * token_bytes / 2**30),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs),
             "--prefill-chunk", str(args.prefill_chunk), "--no-constrain-auto", "--served-model-name", "bench",
             *system.flags]
    return start_engine_server(args.model, threads=args.threads, extra_args=flags, log=log, env=system.env)


def warm(server: ServerProcess, prompt_tokens: int) -> None:
    """Untimed: a short request, then a long one that shares nothing with
    the run's prompts (vLLM compiles, and our kernels meet a prompt's shapes)."""
    import openai

    warm_up(server.base_url)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=1800)
    text = " ".join(f"warm{i % 97}" for i in range(prompt_tokens // 3))
    client.chat.completions.create(model="bench", messages=[{"role": "user", "content": text}], max_tokens=8,
                                   temperature=0.0, extra_body={"ignore_eos": True})


def run_system(name: str, traces: list[Trace], args: argparse.Namespace, cell: dict, repeat: int,
               out: Path) -> dict:
    system = SYSTEMS[name]
    log = out / f"{name}-{cell['agents']}a-{cell['fraction']}-r{repeat}.log"
    server = start_server(system, args, cell, log)
    tag = f"r{repeat}"
    sent = Sent()
    try:
        warm(server, args.prefill_chunk * 2)
        before = server.metrics()
        send = openai_send(server.base_url, system.sessions, tag)
        pauses = TracePauses(args.seed, args.pause_scale)
        with tqdm(desc=f"{name} x{cell['agents']} {cell['fraction']:.0%} r{repeat}", unit="request",
                  total=cell["requests"], file=sys.stderr) as bar:
            jobs = {t.agent: replay_job(t, send, args.max_tokens, pauses, "bench", sent, bar.update) for t in traces}
            records, wall = run_all(jobs)
        counters = delta(before, server.metrics())
        turns = timelines(server.base_url, tag, [t.agent for t in traces]) if system.sessions and not system.vllm else []
    finally:
        server.stop()
    computed = counters["computed_tokens"]
    if computed is None and counters["vllm_cached_tokens"] is not None:
        computed = counters["prompt_tokens_server"] - counters["vllm_cached_tokens"]
    row = {"system": name, "repeat": repeat, **{k: v for k, v in cell.items() if k != "prompts"},
           **summarize(records, wall), **counters, "computed_server": computed,
           "recomputed_tokens": None if computed is None else max(0, computed - cell["needed_tokens"]),
           "stream_digest": stream_digest(sent.digests), "timeline": turns, "startup_s": server.startup_s,
           "records": records_json(records)}
    if system.vllm:
        row["vllm_kv_log"] = vllm_kv_line(log)
    write_json(log.with_suffix(".json"), row)  # an interrupted sweep keeps the runs it finished
    return row


def needed_tokens(prompts: dict[str, list[list[int]]], footprint: dict) -> int:
    """Prompt tokens no cache can avoid computing: the distinct prompt tokens (every reply is generated, not prefilled)."""
    return footprint["distinct_tokens"] - len(prompts) * footprint["max_tokens"]


def cell_for(traces: list[Trace], tokenizer, args: argparse.Namespace, cfg, fraction: float) -> dict | None:
    prompts = render_prompts(tokenizer, traces)
    fp = {**replay_footprint(prompts, args.max_tokens), "max_tokens": args.max_tokens}
    try:
        tokens = budget_tokens(fp, fraction, UNIT)
    except ValueError as e:
        print(f"skipped {len(traces)} agents at {fraction:.0%}: {e}")
        return None
    if fp["longest_request_tokens"] > cfg.max_position_embeddings:
        raise SystemExit(f"the longest request ({fp['longest_request_tokens']} tokens) passes the model's "
                         f"{cfg.max_position_embeddings} positions: give --max-positions")
    return {"agents": len(traces), "fraction": fraction, "budget_tokens": tokens, **fp,
            "needed_tokens": needed_tokens(prompts, fp), "token_bytes": kv_bytes_per_token(cfg, args.dtype),
            "max_model_len": min(cfg.max_position_embeddings, max(tokens, fp["longest_request_tokens"])),
            "private_tokens_median": statistics.median(len(ps[-1]) for ps in prompts.values()) - min(
                len(ps[0]) for ps in prompts.values())}


def over_repeats(rows: list[dict], base: str) -> list[dict]:
    """Per cell and system: medians over repeats with min-max, and the job
    p50 as a multiple of `base`'s (the median of the per-repeat ratios)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["agents"], r["fraction"], r["system"]), []).append(r)
    out = []
    for (agents, fraction, system), runs in groups.items():
        ref = {r["repeat"]: r["job_s_median"] for r in groups.get((agents, fraction, base), [])}
        ratios = [r["job_s_median"] / ref[r["repeat"]] for r in runs if ref.get(r["repeat"])]
        jobs = [r["job_s_median"] for r in runs]
        med = lambda k: median([r[k] for r in runs if r[k] is not None])  # noqa: E731
        out.append({"system": system, "agents": agents, "fraction": fraction, "repeats": len(runs),
                    "job_s_median": median(jobs), "job_s_min": min(jobs), "job_s_max": max(jobs),
                    "job_s_p90": med("job_s_p90"), "turn_s_p50": med("turn_s_p50"), "turn_s_p90": med("turn_s_p90"),
                    "recomputed_tokens": med("recomputed_tokens"), "computed_server": med("computed_server"),
                    "preemptions": med("preemptions"), "errors": sum(len(r["errors"]) for r in runs),
                    "ratio": median(ratios), "distinct_tokens": runs[0]["distinct_tokens"],
                    "budget_tokens": runs[0]["budget_tokens"], "working_set_tokens": runs[0]["working_set_tokens"]})
    return out


def fmt(x, spec: str = ".1f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


HEADERS = ["system", "agents", "budget / distinct (/ working set)", "repeats", "job s p50 (min-max)", "job s p90",
           "turn s p50", "turn s p90", "computed tok", "recomputed tok", "preemptions", "errors", "job p50 / base"]


def summary_rows(summary: list[dict]) -> list[list]:
    return [[s["system"], s["agents"],
             f"{s['budget_tokens']}/{s['distinct_tokens']} = {s['budget_tokens'] / s['distinct_tokens']:.0%} "
             f"({s['budget_tokens'] / s['working_set_tokens']:.0%})", s["repeats"],
             f"{fmt(s['job_s_median'])} ({fmt(s['job_s_min'])}-{fmt(s['job_s_max'])})", fmt(s["job_s_p90"]),
             fmt(s["turn_s_p50"], ".2f"), fmt(s["turn_s_p90"], ".2f"), fmt(s["computed_server"], ".0f"),
             fmt(s["recomputed_tokens"], ".0f"), fmt(s["preemptions"], ".0f"), s["errors"],
             f"{fmt(s['ratio'], '.2f')}x"] for s in summary]


TIMELINE = ("queued_s", "prefill_s", "decode_s", "other_s")
TIMELINE_HEADERS = ["system", "agents", "budget / distinct", "repeat", "requests", "queued s", "prefill s", "decode s",
                    "other s", "engine busy", "idle, requests waiting: " + " / ".join(STALLS) + " s"]


def timeline_rows(rows: list[dict]) -> list[list]:
    """Where our requests' latency went, summed over the run (server side),
    the share of the run's wall time the engine spent in steps, and the
    seconds it idled while requests waited, by why they waited (what the
    policy's waits cost)."""
    return [[r["system"], r["agents"], f"{r['fraction']:.0%}", r["repeat"], len(r["timeline"]),
             *(fmt(sum(t[k] for t in r["timeline"])) for k in TIMELINE),
             "n/a" if r.get("step_s") is None else f"{r['step_s'] / r['wall_s']:.0%}",
             " / ".join(fmt(r.get(f"stalled_{cause}_s")) for cause in STALLS)]
            for r in rows if r["timeline"]]


def plot(res: dict, path: Path) -> None:
    """Per agent count: median job time against the budget (fraction of distinct tokens), a line per system."""
    rows = res["summary"]
    plt = pyplot()
    counts = sorted({r["agents"] for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(5.5 * len(counts), 4.5), squeeze=False)
    for ax, n in zip(axes[0], counts):
        for system in dict.fromkeys(r["system"] for r in rows):
            pts = sorted((r for r in rows if r["system"] == system and r["agents"] == n), key=lambda r: r["fraction"])
            if not pts:
                continue
            xs = [r["fraction"] for r in pts]
            ax.errorbar(xs, [r["job_s_median"] for r in pts], marker="o", label=system, capsize=3,
                        yerr=[[r["job_s_median"] - r["job_s_min"] for r in pts],
                              [r["job_s_max"] - r["job_s_median"] for r in pts]])
        ax.set_title(f"{n} agents ({res['args']['family']})")
        ax.set_xlabel("KV budget / distinct tokens")
        ax.set_ylabel("job completion per agent, median (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def run(args: argparse.Namespace) -> dict:
    systems = parse_systems(args.systems, tuple(SYSTEMS))
    skipped = {}
    if any(SYSTEMS[s].vllm for s in systems) and (why := vllm_status()):
        for s in [s for s in systems if SYSTEMS[s].vllm]:
            skipped[s] = why
            systems.remove(s)
    out = run_dir("bench_replay", args.out)
    if args.dtype == "auto":  # bf16 where the CPU computes in it, as serve.py's --dtype auto
        args.dtype = "bfloat16" if cpu_has_bf16_dot() else "float32"
    args.model = hf_checkpoint(args.model, args.dtype)
    if args.max_positions:
        args.model = with_positions(args.model, args.max_positions)
    tokenizer = load_tokenizer(args.model)
    cfg = model_config(args.model)
    rows, streams = [], {}
    for n in [int(x) for x in str(args.agents).split(",")]:
        traces = build_traces(args.family, n, args.seed, args.user_turns, args.roles)
        for fraction in [float(x) for x in str(args.fractions).split(",")]:
            cell = cell_for(traces, tokenizer, args, cfg, fraction)
            if cell is None:
                continue
            for repeat in range(args.repeats):
                for name in rotation(systems, repeat):
                    row = run_system(name, traces, args, cell, repeat, out)
                    streams.setdefault((n, fraction), set()).add(row["stream_digest"])
                    rows.append(row)
    identical = all(len(d) == 1 for d in streams.values())
    base = systems[0] if systems else "agentkv"
    return {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "machine": machine(),
            "skipped": skipped, "rows": rows, "summary": over_repeats(rows, base), "base": base,
            "streams_identical": identical, "out_dir": str(out)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="bfcl-long", choices=FAMILIES)
    p.add_argument("--agents", default="8", help="concurrent agents; a comma list sweeps (8,16,32)")
    p.add_argument("--fractions", default="0.25,0.5,1.0", help="KV budget / the agents' distinct tokens; a comma list")
    p.add_argument("--roles", default=None, help="bfcl: the agents' BFCL classes, comma-separated, agents spread "
                   "over them in turn (a role of several classes joins them with +; default GorillaFileSystem,TradingBot)")
    p.add_argument("--user-turns", type=int, default=3, help="agentdojo: user tasks chained per agent")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens every reply generates (ignore_eos)")
    p.add_argument("--pause-scale", type=float, default=1.0, help="multiplies every tool pause (0: none)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"of {', '.join(SYSTEMS)}; the first is "
                   "the base of the ratios")
    p.add_argument("--repeats", type=int, default=3, help="runs of every cell, the systems' order rotated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every server")
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPE_BYTES)],
                   help="auto: bfloat16 on a CPU with AVX512-BF16, else float32")
    p.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-agent",
                   help="every system serves this checkpoint (a GGUF or adapter is exported once to HF first)")
    p.add_argument("--max-positions", type=int, default=None,
                   help="serve the same weights with this many positions (a replay past the model's context)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="every server's tokens per step")
    p.add_argument("--max-num-seqs", type=int, default=256, help="every server's requests per step")
    p.add_argument("--prefill-chunk", type=int, default=512, help="our servers' prompt chunk")
    p.add_argument("--vllm-block-size", type=int, default=128, choices=(16, 32, 64, 128),
                   help="vLLM's KV block (measure 32 against 128 on the host and keep the faster)")
    p.add_argument("--out", default=None)
    p.add_argument("--no-wandb", action="store_true")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    res = run(args)
    res["command"] = "python -m agentkv.experiments.benchmarks.bench_replay " + " ".join(
        sys.argv[1:] if argv is None else argv)
    text = report(res)
    summary = {f"{s['system']}/{s['agents']}/{s['fraction']}/{k}": s[k] for s in res["summary"]
               for k in ("job_s_median", "ratio") if not math.isnan(s[k])}
    wandb = None if args.no_wandb else WandbRun("bench_replay", res["args"], summary,
                                                tables={"summary": (HEADERS, summary_rows(res["summary"]))})
    publish(Path(res["out_dir"]), res, text, plots={"bench_replay.png": plot} if res["rows"] else {}, wandb=wandb)
    return res


def report(res: dict) -> str:
    a, rows = res["args"], res["rows"]
    cells = {(r["agents"], r["fraction"]): r for r in rows}
    m = res["machine"]
    lines = [f"host: {m['cpu']}, {m['cores']} cores, {' '.join(m['isa'])}; commit {m['commit']}",
             f"command: {res['command']}",
             f"replay of {a['family']}: greedy, {a['max_tokens']} tokens per reply (ignore_eos), model {a['model']} "
             f"({a['dtype']}), {a['threads']} threads per server, every server's step {a['max_num_batched_tokens']} "
             f"tokens / {a['max_num_seqs']} sequences; vLLM block {a['vllm_block_size']}, torch.compile on",
             f"tool pauses x{a['pause_scale']}: {PAUSE_SOURCE}",
             "request streams identical across systems: " + ("yes" if res["streams_identical"] else "NO")]
    for (n, fr), r in sorted(cells.items()):
        lines.append(f"{n} agents at {fr:.0%}: distinct {r['distinct_tokens']} tokens, working set "
                     f"{r['working_set_tokens']}, budget {r['budget_tokens']} ({r['budget_tokens'] / r['distinct_tokens']:.0%}"
                     f" of distinct, {r['budget_tokens'] / r['working_set_tokens']:.0%} of the working set), "
                     f"{r['requests']} requests, longest {r['longest_request_tokens']}, median private context "
                     f"{r['private_tokens_median']:.0f}")
    lines += [f"Medians over repeats (min-max), job p50 / {res['base']}'s: the median of the per-repeat ratios:",
              table(HEADERS, summary_rows(res["summary"])),
              "Where our requests' time went (server side, seconds summed over the run):",
              table(TIMELINE_HEADERS, timeline_rows(rows))]
    lines += [f"{r['system']} x{r['agents']}: {r['vllm_kv_log']}" for r in rows if r.get("vllm_kv_log")]
    lines += [f"skipped {s}: {why}" for s, why in res["skipped"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
