"""Many agents against replicas behind vllm-router (serve.py cluster): the
many-agents workload of experiments/benchmarks/bench_agents.py (live tool-calling
jobs, seeded tool pauses; experiments/workloads/agent_runs.py), each agent's requests
carrying its X-Session-Id, against four set-ups on this machine, one core
per replica:

- 1 replica: the router in front of one serve.py (the reference hit rate);
- 2 replicas, consistent_hash: the router hashes X-Session-Id (affinity);
- 2 replicas, round_robin: the ablation, turns alternate between replicas;
- 2 replicas, consistent_hash, replica 0 killed (SIGKILL) once half of the
  planned turns are done: its sessions continue on the other from the
  shared state directory;
- the same with a planned drain of replica 0 instead (Cluster.drain: out of
  the router, then SIGTERM; its turns in flight finish there).

and the Responses API on 2 replicas: each agent's job as one conversation
chained by previous_response_id (the shared system prompt as instructions,
the task, then each tool result as the next turn's input), with the agent's
X-Session-Id (responses_affinity) and without one (responses_any: the
router hashes the body, so a turn lands on either replica, which continues
from the record and KV the other saved). What the second costs is the
turns' latency and the KV restored from the shared disk tier.

The KV pool of every replica holds the whole working set, so hits and
misses are the routing's, not eviction's. Reported per set-up: per-turn
latency (p50, p90), turns done and failed (a failed turn ends its agent's
job), the prefix-cache hit rate of each replica and of all
(vllm:prefix_cache_hits_total / queries: tokens), prompt tokens computed,
sessions held by more than one replica (moved), and for the kill: the
sessions the dead replica held, the time from the kill to the first turn
of one of them completed on the survivor (recovery; for a drain, of the
first turn sent after the drain began: those in flight finish on the
draining replica), and the prompt tokens computed beyond the uninterrupted
affinity run (recomputed).

    python -m agentkv.experiments.benchmarks.bench_replicas [--agents 8] [--turns-per-agent 4] [--max-tokens 32] \\
        [--pause-scale 0.25] [--setups one,affinity,round_robin,kill,drain,responses_affinity,responses_any] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

from agentkv.engine.api.cluster import Cluster
from agentkv.experiments.common import machine, parse_systems, run_dir
from agentkv.experiments.drivers.servers import free_port, scrape_metrics
from agentkv.experiments.drivers.system import ROOT
from agentkv.experiments.report import publish, table
from agentkv.experiments.workloads.agent_runs import (Pauses, Reply, openai_reply, plan, records_json, run_agents,
                                                      summarize)

# name: replicas, router policy, what happens to replica 0 half-way (None, "kill", "drain")
SETUPS = {"one": (1, "consistent_hash", None), "affinity": (2, "consistent_hash", None),
          "round_robin": (2, "round_robin", None), "kill": (2, "consistent_hash", "kill"),
          "drain": (2, "consistent_hash", "drain")}
RESPONSES = {"responses_affinity": True, "responses_any": False}  # name: whether turns carry X-Session-Id
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
COMPUTED, RESTORED = "agentkv_computed_tokens_total", "agentkv_kv_restored_tokens_total"


class Calls:
    """An openai client per agent with its X-Session-Id, and when each call started and ended."""

    def __init__(self, base_url: str, tag: str):
        self.base_url, self.tag = base_url, tag
        self.log: list[tuple[str, float, float, bool]] = []  # agent, start, end, ok
        self._clients: dict = {}
        self._lock = threading.Lock()

    def session(self, agent: str) -> str:
        return f"{self.tag}-{agent}"

    def __call__(self, agent: str, messages: list[dict], tools: list[dict], max_tokens: int) -> Reply:
        import openai

        client = self._clients.get(agent)
        if client is None:
            # Two retries: a turn in flight on a replica that dies is sent again, and lands on the survivor.
            client = self._clients[agent] = openai.OpenAI(
                base_url=self.base_url, api_key="unused", max_retries=2, timeout=600,
                default_headers={"X-Session-Id": self.session(agent)})
        start, ok = time.monotonic(), False
        try:
            reply = openai_reply(client.chat.completions.create(model="bench", messages=messages, tools=tools,
                                                                max_tokens=max_tokens, temperature=0.0))
            ok = True
            return reply
        finally:
            with self._lock:
                self.log.append((agent, start, time.monotonic(), ok))


def held_sessions(url: str) -> set[str]:
    with urllib.request.urlopen(url + "/v1/sessions", timeout=30) as r:
        return {s["id"] for s in json.loads(r.read())["data"]}


def run_setup(name: str, args: argparse.Namespace, out: Path) -> dict:
    replicas, policy, loss = SETUPS[name]
    wf = plan(args.seed, args.agents, args.turns_per_agent)
    planned = sum(len(c.copied) for c in wf.conversations)
    serve_args = ["--model", str(args.model), "--served-model-name", "bench", "--kv-cache-gb", str(args.kv_cache_gb),
                  "--no-constrain-auto"]
    with tempfile.TemporaryDirectory(prefix=f"bench_replicas-{name}-") as state:
        cluster = Cluster(replicas, state, port=free_port(), replica_ports=[free_port() for _ in range(replicas)],
                          metrics_port=free_port(), policy=policy, threads=args.threads, serve_args=serve_args,
                          log_dir=out / f"logs-{name}")
        with cluster:
            before = [scrape_metrics(u) for u in cluster.replica_urls]
            calls = Calls(cluster.url + "/v1", f"s{args.seed}")
            done = threading.Semaphore(0)
            killed: dict = {}

            def killer() -> None:
                for _ in range(planned // 2):
                    done.acquire()
                killed["victims"] = held_sessions(cluster.replica_urls[0])
                killed["at"] = time.monotonic()
                getattr(cluster, loss)(0)

            if loss:
                threading.Thread(target=killer, daemon=True).start()
            with tqdm(total=planned, desc=name, unit="turn") as bar:
                records, wall = run_agents(wf, calls, args.max_tokens, Pauses(args.seed, args.pause_scale),
                                           lambda: (bar.update(), done.release()))
            alive = [i for i, p in enumerate(cluster.replicas) if p.alive()]
            after = {i: scrape_metrics(cluster.replica_urls[i]) for i in alive}
            held = {i: held_sessions(cluster.replica_urls[i]) for i in alive}
    per_replica = {}
    for i, m in after.items():
        hits, queries = m[HITS] - before[i][HITS], m[QUERIES] - before[i][QUERIES]
        per_replica[i] = {"hits": hits, "queries": queries, "hit_rate": hits / queries if queries else None,
                          "computed": m[COMPUTED] - before[i][COMPUTED], "restored": m[RESTORED] - before[i][RESTORED],
                          "sessions": len(held[i])}
    sessions = [s for h in held.values() for s in h]
    row = {"setup": name, "replicas": replicas, "policy": policy, "planned": planned, **summarize(records, wall),
           "per_replica": per_replica, "moved": len(sessions) - len(set(sessions)),
           "records": records_json(records)}
    if loss:
        victims = killed.get("victims", set())
        at = killed.get("at", float("inf"))
        # Recovery: a kill's turns in flight fail and are sent again (the client's retry), to the survivor; a
        # drain's finish where they were, so its recovery is that of the first turn sent after it began.
        first = [end for agent, start, end, ok in calls.log
                 if ok and calls.session(agent) in victims and end > at and (loss == "kill" or start > at)]
        # An agent's calls are its turns in order: those of a victim not ended at the kill ran on the survivor.
        after_kill = {a.agent: sum(1 for agent, _, end, _ in calls.log if agent == a.agent and end <= killed["at"])
                      for a in records if calls.session(a.agent) in victims}
        row.update(victims=len(victims), recovery_s=min(first) - killed["at"] if first else None,
                   failed_calls=sum(not ok for *_, ok in calls.log), victim_turns_from=after_kill)
    return row


class ResponsesCalls:
    """An agent's turns as one Responses API conversation: the system prompt
    as instructions, each turn's new messages as its input, chained by
    previous_response_id (the history is the server's, not re-sent)."""

    def __init__(self, base_url: str, tag: str, affinity: bool):
        self.base_url, self.tag, self.affinity = base_url, tag, affinity
        self.last: dict[str, tuple[str, int]] = {}  # agent: its last response and how many messages it covered

    def __call__(self, agent: str, messages: list[dict], tools: list[dict], max_tokens: int) -> Reply:
        previous, seen = self.last.get(agent, (None, 1))
        new = [{"role": "user", "content": m["content"] if m["role"] == "user" else f"Tool result: {m['content']}"}
               for m in messages[seen:] if m["role"] in ("user", "tool")]
        body = {"model": "bench", "instructions": messages[0]["content"], "input": new,
                "max_output_tokens": max_tokens, "temperature": 0.0}
        if previous is not None:
            body["previous_response_id"] = previous
        headers = {"X-Session-Id": f"{self.tag}-{agent}"} if self.affinity else {}
        req = urllib.request.Request(self.base_url + "/v1/responses", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **headers})
        with urllib.request.urlopen(req, timeout=600) as r:
            got = json.loads(r.read())
        self.last[agent] = (got["id"], len(messages) + 1)  # the reply is the server's now
        usage = got["usage"]
        text = "".join(part.get("text", "") for item in got["output"] for part in item.get("content") or [])
        return Reply(text, [], usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"],
                     "stop" if got["status"] == "completed" else "length", usage["output_tokens"])


def run_responses(name: str, args: argparse.Namespace, out: Path) -> dict:
    wf = plan(args.seed, args.agents, args.turns_per_agent)
    planned = sum(len(c.copied) for c in wf.conversations)
    serve_args = ["--model", str(args.model), "--served-model-name", "bench", "--kv-cache-gb", str(args.kv_cache_gb),
                  "--no-constrain-auto"]
    with tempfile.TemporaryDirectory(prefix=f"bench_replicas-{name}-") as state:
        cluster = Cluster(2, state, port=free_port(), replica_ports=[free_port(), free_port()],
                          metrics_port=free_port(), threads=args.threads, serve_args=serve_args,
                          log_dir=out / f"logs-{name}")
        with cluster:
            before = [scrape_metrics(u) for u in cluster.replica_urls]
            calls = ResponsesCalls(cluster.url, f"s{args.seed}", RESPONSES[name])
            with tqdm(total=planned, desc=name, unit="turn") as bar:
                records, wall = run_agents(wf, calls, args.max_tokens, Pauses(args.seed, args.pause_scale),
                                           bar.update)
            after = [scrape_metrics(u) for u in cluster.replica_urls]
    per_replica = {}
    for i, (b, a) in enumerate(zip(before, after)):
        hits, queries = a[HITS] - b[HITS], a[QUERIES] - b[QUERIES]
        per_replica[i] = {"hits": hits, "queries": queries, "hit_rate": hits / queries if queries else None,
                          "computed": a[COMPUTED] - b[COMPUTED], "restored": a[RESTORED] - b[RESTORED]}
    return {"setup": name, "replicas": 2, "policy": "consistent_hash", "planned": planned,
            **summarize(records, wall), "per_replica": per_replica, "moved": None, "records": records_json(records)}


def computed_usage(row: dict) -> int:
    return sum(t["prompt_tokens"] - t["cached_tokens"] for r in row["records"] for t in r["turns"] if not t["error"])


def recomputed(kill: dict, affinity: dict) -> int:
    """Prompt tokens the dead replica's sessions computed on the survivor beyond what the same turns
    computed in the uninterrupted run (greedy: the same prompts)."""
    def computed(row: dict) -> dict[tuple[str, int], int]:
        return {(r["agent"], t["turn"]): t["prompt_tokens"] - t["cached_tokens"]
                for r in row["records"] for t in r["turns"] if not t["error"]}
    ref, got = computed(affinity), computed(kill)
    return sum(max(0, n - ref.get(key, 0)) for key, n in got.items()
               if key[0] in kill["victim_turns_from"] and key[1] >= kill["victim_turns_from"][key[0]])


HEADERS = ["setup", "replicas", "policy", "turns done", "failed", "turn s p50", "turn s p90", "hit rate (all)",
           "hit rate per replica", "prompt tok computed", "tok restored from disk", "sessions moved",
           "lost: sessions / recovery s / recomputed"]


def table_rows(rows: list[dict]) -> list[list]:
    affinity = next((r for r in rows if r["setup"] == "affinity"), None)
    out = []
    for r in rows:
        reps = r["per_replica"]
        hits, queries = sum(v["hits"] for v in reps.values()), sum(v["queries"] for v in reps.values())
        kill = "-"
        if "victims" in r:
            extra = recomputed(r, affinity) if affinity else None
            rec = "n/a" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
            kill = f"{r['victims']} / {rec} / {extra if extra is not None else 'n/a'}"
        out.append([r["setup"], r["replicas"], r["policy"], f"{r['completed_turns']}/{r['planned']}",
                    len(r["errors"]), f"{r['turn_s_p50']:.2f}", f"{r['turn_s_p90']:.2f}",
                    f"{hits / queries:.3f}" if queries else "n/a",
                    " ".join(f"r{i}:{v['hit_rate']:.3f}" if v["hit_rate"] is not None else f"r{i}:n/a"
                             for i, v in reps.items()),
                    computed_usage(r), int(sum(v["restored"] for v in reps.values())),
                    "-" if r["moved"] is None else r["moved"], kill])
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--turns-per-agent", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--pause-scale", type=float, default=0.25, help="multiplies every tool pause (0: none)")
    p.add_argument("--setups", default=",".join([*SETUPS, *RESPONSES]))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each replica")
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="each replica's pool (default: the whole working set)")
    p.add_argument("--model", type=Path, default=ROOT / "models" / "agent-8m")
    p.add_argument("--out", default=None, help="run folder (default runs/bench_replicas-<time>)")
    args = p.parse_args(argv)
    setups = parse_systems(args.setups, (*SETUPS, *RESPONSES))
    out = run_dir("bench_replicas", args.out)
    rows = [run_responses(name, args, out) if name in RESPONSES else run_setup(name, args, out) for name in setups]
    res = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "machine": machine(),
           "rows": rows}
    lines = [f"{args.agents} agents x {args.turns_per_agent} turns, replies up to {args.max_tokens} tokens, tool "
             f"pauses x{args.pause_scale}, {args.threads} thread(s) per replica; hit rate = prefix-cache hit tokens / "
             f"queried tokens; recomputed = prompt tokens the lost replica's sessions computed after the kill "
             f"or drain beyond the same turns of the affinity run:",
             table(HEADERS, table_rows(rows))]
    publish(out, res, "\n".join(lines))
    return res


if __name__ == "__main__":
    main()
