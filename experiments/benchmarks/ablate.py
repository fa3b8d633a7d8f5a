"""Where the speed comes from: persistent sessions on/off x radix prefix
cache on/off x prompt-lookup speculation on/off, on the interleaved
multi-agent workload (N agents sharing a system prompt and tool set, their
turns arriving interleaved), teacher-forced replay, on the same weights. The
eight configurations run side by side, one engine each: every request is
served by all eight (in rotating order) before the next, so machine noise
falls on all of them alike.

  sessions on   each agent keeps a persistent session: a turn computes only
                what its session does not hold (Engine.chat with session=).
  sessions off  a fresh session per request (a stateless API).
  radix on      the token-granular radix prefix cache: a session holding no
                KV starts from the longest cached prefix (other agents' shared
                system prompt and tools; with sessions off, its own history).
  radix off     prefix_cache=False.
  spec on/off   Engine.chat(speculative=...): n-gram drafts verified k+1 at a
                time. Greedy output is identical either way.

sessions off + radix off is the stateless baseline (every turn re-prefills
its whole history). Speculation on a random-weight model is degenerate (a
model that repeats one token makes prompt-lookup drafts look perfect), so the
acceptance rate is printed: judge speculation on the trained model (--model).

Model: the embedded tiny default model (4 layers, 256 wide), or --model DIR.

    python -m agentkv.experiments.benchmarks.ablate [--agents 4] [--turns-per-agent 4] [--max-gen 48] [--repeats 1]
        [--model DIR] [--threads 2]
"""
from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from agentkv.experiments.common import machine, median, run_dir
from agentkv.experiments.drivers.replay import reply_token_count
from agentkv.experiments.report import WandbRun, publish, pyplot, save_figure, table
from agentkv.experiments.workloads.workflows import interleaved_run

CONFIGS = [dict(sessions=s, radix=r, spec=p) for s, r, p in itertools.product((True, False), repeat=3)]


def name(cfg: dict) -> str:
    return " ".join(f"{k}:{'on' if v else 'off'}" for k, v in cfg.items())


def short(cfg: dict) -> str:
    return "".join(k[0].upper() if v else k[0] for k, v in cfg.items())  # e.g. "SRs"


class Runner:
    """One engine configuration replaying the workload turn by turn."""

    def __init__(self, base, cfg: dict, pages: int):
        from agentkv import Engine

        self.cfg = cfg
        self.eng = Engine(base.model, base.tokenizer, page_size=base.pool.page_size, num_pages=pages,
                          prefix_cache=cfg["radix"])
        self.sessions: dict[str, object] = {}
        self.rows: list[dict] = []

    def turn(self, turn, gen: int) -> None:
        eng, cfg = self.eng, self.cfg
        session = self.sessions.setdefault(turn.agent, eng.session()) if cfg["sessions"] else None
        t0 = time.perf_counter()
        eng.chat(turn.request, tools=turn.tools, session=session, max_tokens=gen, ignore_eos=True,
                 speculative=cfg["spec"])
        latency = time.perf_counter() - t0
        st = eng.stats[-1]
        self.rows.append({"agent": turn.agent, "latency_s": latency, "prompt": st.prompt_tokens,
                          "reused": st.reused_tokens, "computed": st.computed_tokens,
                          "generated": st.generated_tokens, "prefill_s": st.prefill_s, "decode_s": st.decode_s,
                          "decode_steps": st.decode_steps, "drafted": st.drafted_tokens,
                          "accepted": st.accepted_tokens})

    def close(self) -> dict:
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()
        del self.eng
        return {"wall_s": sum(r["latency_s"] for r in self.rows), "turns": self.rows}


def run_repeat(base, turns: list, gens: list[int], pages: int, rep: int, repeats: int) -> dict[str, dict]:
    """All configurations side by side: each request is served by every
    configuration before the next request (in a rotating order), so that
    machine noise falls on all of them alike."""
    runners = [Runner(base, c, pages) for c in CONFIGS]
    for i, (turn, gen) in enumerate(tqdm(list(zip(turns, gens)), desc=f"requests {rep + 1}/{repeats}",
                                         unit="req", leave=False)):
        k = i % len(runners)
        for r in runners[k:] + runners[:k]:
            r.turn(turn, gen)
    out = {name(r.cfg): r.close() for r in runners}
    gc.collect()
    return out


def summarize(reps: list[dict]) -> dict:
    n = len(reps[0]["turns"])
    lat = [median([r["turns"][i]["latency_s"] for r in reps]) for i in range(n)]
    t0 = reps[0]["turns"]
    drafted = sum(t["drafted"] for t in t0)
    return {
        "wall_s": median([r["wall_s"] for r in reps]),
        "e2e_s": sum(lat),
        "median_turn_s": median(lat),
        "per_turn_s": lat,
        "computed_tokens": sum(t["computed"] for t in t0),
        "prompt_tokens": sum(t["prompt"] for t in t0),
        "generated_tokens": sum(t["generated"] for t in t0),
        "prefill_s": sum(t["prefill_s"] for t in t0),
        "decode_s": sum(t["decode_s"] for t in t0),
        "decode_steps": sum(t["decode_steps"] for t in t0),
        "acceptance": sum(t["accepted"] for t in t0) / drafted if drafted else None,
        "repeats": reps,
    }


def run(args) -> dict:
    from agentkv import Engine

    torch.set_num_threads(args.threads)
    base = Engine.from_pretrained(args.model, num_pages=16)
    wf = interleaved_run(args.seed, n_agents=args.agents, turns_per_agent=args.turns_per_agent)
    turns = list(wf.turns())
    tok = base.tokenizer
    gens = []
    longest: dict[str, int] = {}
    for t in turns:
        prompt = tok.apply_chat_template(t.request, tools=t.tools)
        n = reply_token_count(tok, t.request, t.tools, t.reply, prompt)
        gens.append(min(n, args.max_gen) if args.max_gen else n)
        longest[t.agent] = max(longest.get(t.agent, 0), len(prompt) + gens[-1])
    ps = base.pool.page_size
    pages = 2 * (sum(longest.values()) // ps + len(turns)) + 64
    # Warm-up: one short turn on a throwaway engine.
    warm = Engine(base.model, tok, page_size=ps, num_pages=max(64, longest[turns[0].agent] // ps + 8),
                  prefix_cache=False)
    warm.chat(turns[0].request, tools=turns[0].tools, max_tokens=4, ignore_eos=True)
    del warm
    reps: dict[str, list[dict]] = {name(c): [] for c in CONFIGS}
    for rep in range(args.repeats):
        for key, res in run_repeat(base, turns, gens, pages, rep, args.repeats).items():
            reps[key].append(res)
    results = {name(c): {"config": c, **summarize(reps[name(c)])} for c in CONFIGS}
    baseline = results[name(dict(sessions=False, radix=False, spec=False))]
    for r in results.values():
        r["speedup_e2e_vs_stateless"] = baseline["e2e_s"] / r["e2e_s"]
        r["speedup_median_turn_vs_stateless"] = baseline["median_turn_s"] / r["median_turn_s"]
    return {
        "command": " ".join([sys.executable, "-m", "agentkv.experiments.benchmarks.ablate", *sys.argv[1:]]),
        "args": vars(args),
        "machine": machine() | {"load": os.getloadavg()},
        "workload": {"shape": wf.shape, "agents": args.agents, "turns_per_agent": args.turns_per_agent,
                     "turns": len(turns), "gen_per_turn": gens, "schedule": wf.schedule},
        "results": results,
    }


def report(res: dict) -> str:
    heads = ["sessions", "radix", "spec", "e2e s", "median turn ms", "speed-up e2e", "computed tok", "prefill s",
             "decode s", "decode steps", "accept"]
    rows = []
    for r in res["results"].values():
        c = r["config"]
        rows.append(["on" if c["sessions"] else "off", "on" if c["radix"] else "off", "on" if c["spec"] else "off",
                     r["e2e_s"], r["median_turn_s"] * 1e3, f"{r['speedup_e2e_vs_stateless']:.2f}x",
                     r["computed_tokens"], r["prefill_s"], r["decode_s"], r["decode_steps"],
                     f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"])
    w = res["workload"]
    foot = (f"{w['agents']} agents x {w['turns_per_agent']} turns ({w['turns']} requests), "
            f"{sum(w['gen_per_turn'])} tokens generated in all; speed-ups vs sessions/radix/spec all off")
    return table(heads, rows) + "\n" + foot


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    names = list(res["results"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [n.replace("sessions", "sess").replace(" ", "\n") for n in names]
    pre = [res["results"][n]["prefill_s"] for n in names]
    dec = [res["results"][n]["decode_s"] for n in names]
    other = [max(res["results"][n]["e2e_s"] - p - d, 0.0) for n, p, d in zip(names, pre, dec)]
    ax1.bar(labels, pre, label="prefill")
    ax1.bar(labels, dec, bottom=pre, label="decode")
    ax1.bar(labels, other, bottom=[p + d for p, d in zip(pre, dec)], label="other (render, tokenize, bookkeeping)")
    ax1.set_ylabel("end-to-end seconds (sum of turns)")
    ax1.tick_params(axis="x", labelsize=7)
    ax1.legend(fontsize=8)
    ax1.set_title("where the time goes")
    for n in names:
        ax2.plot(range(1, len(res["results"][n]["per_turn_s"]) + 1), res["results"][n]["per_turn_s"], marker=".",
                 label=n)
    ax2.set_yscale("log")
    ax2.set_xlabel("request (interleaved agents)")
    ax2.set_ylabel("turn latency (s, log)")
    ax2.legend(fontsize=6)
    ax2.grid(alpha=0.3, which="both")
    fig.suptitle(f"ablation: {res['workload']['agents']} interleaved agents, median of {res['args']['repeats']}")
    save_figure(fig, path)


def wandb_run(res: dict) -> WandbRun:
    cols = ["sessions", "radix", "spec", "e2e_s", "median_turn_s", "computed_tokens", "speedup_e2e"]
    data = [[r["config"]["sessions"], r["config"]["radix"], r["config"]["spec"], r["e2e_s"], r["median_turn_s"],
             r["computed_tokens"], r["speedup_e2e_vs_stateless"]] for r in res["results"].values()]
    summary = {f"{short(r['config'])}/e2e_s": r["e2e_s"] for r in res["results"].values()}
    return WandbRun("ablate", {**res["args"], "command": res["command"]}, summary, tables={"ablation": (cols, data)})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--turns-per-agent", type=int, default=4)
    p.add_argument("--max-gen", type=int, default=48, help="cap each turn's generated tokens")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--no-wandb", action="store_true")
    args = p.parse_args(argv)
    res = run(args)
    out = run_dir("ablate", args.out)
    publish(out, res, report(res), plots={"ablation.png": plot}, wandb=None if args.no_wandb else wandb_run(res))
    return res


if __name__ == "__main__":
    main()
