"""The main job: agents replaying BFCL v4's long-context multi-turn tasks
(every user turn, the ground-truth calls and their real outputs from BFCL's
own classes) against this engine's server, under true KV pressure (a
budget that is a fraction of the agents' distinct tokens), with seeded
tool pauses from a published statistic of real agents' tool calls; beside
it the same engine as a block-hash prefix cache (vLLM's policy, 16-token
blocks, no sessions), and with --peers vllm, vLLM's own server at its best.
Every system serves the same checkpoint over HTTP, gets the same request
stream and the same KV tokens; speculation off on all.

A preset of experiments/benchmarks/bench_replay.py, which holds the
systems, the ablations and the report; --full is its whole sweep.

    python serve.py demo [--agents 4] [--fraction 0.46] [--pause-scale 0.25] [--peers vllm] [--out DIR]
    python serve.py demo --full [--peers vllm]   # 8/16/32 agents x 25/50/100% of distinct, every ablation, 3 repeats
"""
from __future__ import annotations

import argparse
import time

from agentkv.experiments.benchmarks import bench_replay
from agentkv.kernels.cpu_extension import isa
from agentkv.kernels.dispatch import build_cpu_kernels

# Single-class BFCL roles whose long-context tool outputs give each agent
# thousands of private tokens behind a shared head (its function docs).
ROLES = "VehicleControlAPI,TravelAPI"
# The default job is sized for a short run on 2 cores (docs/bench_replay.md):
# 4 agents at 46% of their distinct tokens (the least that holds the longest
# agent's context), the published pauses at a quarter of their length.
SYSTEMS = ("agentkv", "agentkv-block16")
FULL_AGENTS, FULL_FRACTIONS = "8,16,32", "0.25,0.5,1.0"


def replay_argv(args: argparse.Namespace) -> list[str]:
    systems = list(bench_replay.DEFAULT_SYSTEMS if args.full else SYSTEMS)
    systems = [s for s in systems if not bench_replay.SYSTEMS[s].vllm] + (["vllm"] if "vllm" in args.peers else [])
    argv = ["--family", "bfcl-long", "--roles", ROLES, "--systems", ",".join(systems),
            "--agents", FULL_AGENTS if args.full else str(args.agents),
            "--fractions", FULL_FRACTIONS if args.full else str(args.fraction),
            "--repeats", "3" if args.full else str(args.repeats), "--max-tokens", str(args.max_tokens),
            "--pause-scale", "1" if args.full else str(args.pause_scale), "--max-positions", str(args.max_positions), "--dtype", args.dtype,
            "--threads", str(args.threads), "--seed", str(args.seed)]
    argv += ["--model", args.model] if args.model else []
    argv += ["--out", args.out] if args.out else []
    return argv


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="serve.py demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=4, help="agents at once")
    p.add_argument("--fraction", type=float, default=0.46, help="KV budget / the agents' distinct tokens")
    p.add_argument("--repeats", type=int, default=1, help="runs of each system, the order rotated")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens every reply generates (ignore_eos)")
    p.add_argument("--pause-scale", type=float, default=0.25,
                   help="multiplies every tool pause (0: none; --full uses the published lengths, 1)")
    p.add_argument("--max-positions", type=int, default=16384,
                   help="the model's positions for the replay (the embedded model's 8,192 are fewer than the "
                        "longest agent's context: the same weights served longer, for serving, not answers)")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on a CPU with AVX512-BF16, else float32")
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded agent model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full", action="store_true", help="the whole sweep and every ablation (hours)")
    p.add_argument("--peers", default="", help="vllm: vLLM's own server beside (bash experiments/drivers/peers/setup_vllm.sh)")
    p.add_argument("--out", default=None, help="the run's folder (default runs/bench_replay-<time>)")
    args = p.parse_args(argv)
    args.peers = [x for x in args.peers.split(",") if x]
    if set(args.peers) - {"vllm"}:
        p.error(f"--peers takes vllm, not {args.peers}")
    started = time.perf_counter()
    failed = build_cpu_kernels()  # before any clock starts: a first-use compile is no system's time
    print(f"C++ CPU kernels for {isa()} ready in {time.perf_counter() - started:.1f} s"
          + "".join(f"; {k} did not build ({e}), its torch path runs" for k, e in failed.items()))
    return bench_replay.main(replay_argv(args))


if __name__ == "__main__":
    main()
