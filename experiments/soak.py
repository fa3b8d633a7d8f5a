"""Fault-injection soak against the real server (issue 42): well-behaved
agents of three tenants run their jobs while a fourth tenant is hostile and
the server is hurt, and every turn they complete must be the turn a run
with no faults completes.

    python -m agentkv.experiments.soak            # 32 agents, 6 turns each, 4 tenants (10+ minutes on 2 cores)
    python -m agentkv.experiments.soak --short    # the CI form (tests/test_soak_smoke.py): 6 agents, 2 turns

Three phases, each on a fresh server with the same flags (API keys for four
tenants, a state directory, a KV pool at --kv-fraction of the agents'
working set, a host tier as large, a disk tier capped at --disk-fraction of
it so that it fills):
1. reference: the well-behaved agents alone;
2. hostile: the same agents beside the hostile tenant
   (experiments/workloads/hostile.py: pins, session floods, cache-salt
   cycling, oversized and malformed bodies);
3. faults: the hostile tenant again, and, as the agents run, streams dropped
   before and after their first token, then (the agents held between turns)
   a SIGKILL of the server, a corrupted piece of its saved KV, and a restart
   on the same state directory.
The agents are the generated workflows (experiments/workloads/agent_runs),
each in a named session of its tenant, greedy; each tenant also stores a
Responses API response before the kill and continues it after.

Checks (the CI form asserts them): every turn of phases 2 and 3 equals the
reference's, no 5xx to any tenant, after the restart every named session and
stored response is at its last completed turn, and after each phase, with
every session and response deleted, the pool holds nothing but the prefix
cache. Reported, not asserted: the hostile tenant's effect on the others'
p90 turn latency (phase 2 over phase 1; the target is at most 1.5x).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
from tqdm import tqdm

from agentkv.experiments.benchmarks.bench_agents import hf_checkpoint, kv_bytes_per_token, model_config
from agentkv.experiments.common import machine, run_dir
from agentkv.experiments.drivers.faults import corrupt_piece, drop_stream, kill
from agentkv.experiments.drivers.servers import ServerProcess, free_port, start_engine_server
from agentkv.experiments.report import WandbRun, publish, pyplot, save_figure, table
from agentkv.experiments.workloads.agent_runs import AgentRecord, Client, Pauses, Reply, p90, records_json, run_all
from agentkv.experiments.workloads.agent_workload import AgentWorkload
from agentkv.experiments.workloads.hostile import HostileTenant
from agentkv.model.default import SMALL_MODEL_DIR
from agentkv.model.tokenizer import Tokenizer

MODEL = "soak"
TENANTS = ("acme", "globex", "initech")  # well-behaved
HOSTILE = "mallory"
PHASES = ("reference", "hostile", "faults")
MAX_REQUEST_BYTES = 1 << 20
RETAIN_S = 120.0
UNIT = 16  # the pool's page size: budgets in whole pages
SERVER_DOWN_S = 300.0  # how long a client waits for a killed server to come back
DROPS = 4  # streams the faults phase drops, one after another, all the first tenant's


def key_of(tenant: str) -> str:
    return f"sk-soak-{tenant}-0123456789"


class Gate:
    """Holds the well-behaved agents between turns while the server is killed:
    close() waits until none has a request in flight."""

    def __init__(self):
        self._open = threading.Event()
        self._open.set()
        self._cond = threading.Condition()
        self._inflight = 0

    @contextmanager
    def request(self) -> Iterator[None]:
        while True:
            self._open.wait()
            with self._cond:
                if self._open.is_set():
                    self._inflight += 1
                    break
        try:
            yield
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def close(self, timeout: float) -> None:
        self._open.clear()
        with self._cond:
            if not self._cond.wait_for(lambda: self._inflight == 0, timeout):
                raise TimeoutError(f"requests still in flight after {timeout:.0f} s")

    def open(self) -> None:
        self._open.set()


class Soaked:
    """One phase's server (restartable on its port and state directory) and
    what every tenant got back from it."""

    def __init__(self, model: Path, flags: list[str], log: Path, threads: int):
        self.model, self.flags, self.log, self.threads = model, flags, log, threads
        self.port = free_port()
        self.server = self._start()
        self.statuses: dict[str, Counter[int]] = {t: Counter() for t in TENANTS}
        self.retries = 0  # well-behaved requests re-sent after the server went down under them
        self._lock = threading.Lock()

    def _start(self) -> ServerProcess:
        return start_engine_server(self.model, port=self.port, threads=self.threads, extra_args=self.flags, log=self.log)

    @property
    def url(self) -> str:
        return self.server.url

    def kill(self) -> None:
        kill(self.server)

    def start_again(self) -> float:
        """After kill(): the server on the same port and state; seconds it took to be ready."""
        self.server = self._start()
        return self.server.startup_s

    def count(self, tenant: str, status: int) -> None:
        with self._lock:
            self.statuses[tenant][status] += 1

    def wait_up(self) -> None:
        deadline = time.monotonic() + SERVER_DOWN_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not come back in {SERVER_DOWN_S:.0f} s")


def tenant_of(names: list[str]) -> dict[str, str]:
    return {agent: TENANTS[i % len(TENANTS)] for i, agent in enumerate(names)}


def agent_client(soaked: Soaked, tenants: dict[str, str], gate: Gate) -> Client:
    """Each agent's turns in its tenant's named session (its name), greedy;
    a request the server's death cut off is sent again once it is back."""

    def call(agent: str, messages: list[dict], tools: list[dict], max_tokens: int) -> Reply:
        tenant = tenants[agent]
        body = {"model": MODEL, "messages": messages, "tools": tools, "max_tokens": max_tokens, "temperature": 0.0,
                "session_id": agent}
        with gate.request():
            while True:
                try:
                    r = httpx.post(soaked.url + "/v1/chat/completions", json=body, timeout=900,
                                   headers={"Authorization": f"Bearer {key_of(tenant)}"})
                except httpx.TransportError:
                    soaked.retries += 1
                    soaked.wait_up()
                    continue
                soaked.count(tenant, r.status_code)
                r.raise_for_status()
                return reply_of(r.json())

    return call


def reply_of(data: dict) -> Reply:
    choice, usage = data["choices"][0], data["usage"]
    calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
             for c in choice["message"].get("tool_calls") or []]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Reply(choice["message"].get("content"), calls, usage["prompt_tokens"], cached, choice["finish_reason"],
                 usage["completion_tokens"])


def http(soaked: Soaked, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=soaked.url, headers={"Authorization": f"Bearer {key_of(tenant)}"}, timeout=600)


def store_responses(soaked: Soaked) -> dict[str, dict]:
    """One stored Responses API response per well-behaved tenant: tenant -> its JSON."""
    out = {}
    for tenant in TENANTS:
        with http(soaked, tenant) as c:
            r = c.post("/v1/responses", json={"model": MODEL, "input": f"Summarize the {tenant} backlog.",
                                               "max_output_tokens": 6, "temperature": 0.0})
        soaked.count(tenant, r.status_code)
        r.raise_for_status()
        out[tenant] = r.json()
    return out


def snapshot(soaked: Soaked, tenants: dict[str, str]) -> dict[str, tuple[int, int]]:
    """Each agent's named session: (tokens held, turns recorded)."""
    out = {}
    for agent, tenant in tenants.items():
        with http(soaked, tenant) as c:
            r = c.get(f"/v1/sessions/{agent}")
        if r.status_code == 200:
            out[agent] = (r.json()["length"], len(r.json()["turns"]))
    return out


def check_restart(soaked: Soaked, tenants: dict[str, str], before: dict, stored: dict[str, dict]) -> dict:
    """After the restart: each session at its last completed turn, each stored
    response readable and continued."""
    after = snapshot(soaked, tenants)
    sessions_lost = sorted(a for a, held in before.items() if after.get(a) != held)
    responses_lost, continued = [], []
    for tenant, made in list(stored.items()):
        with http(soaked, tenant) as c:
            got = c.get(f"/v1/responses/{made['id']}")
            cont = c.post("/v1/responses", json={"model": MODEL, "input": "And the next step?", "max_output_tokens": 4,
                                                 "temperature": 0.0, "previous_response_id": made["id"]})
        for r in (got, cont):
            soaked.count(tenant, r.status_code)
        if got.status_code != 200 or got.json().get("output") != made.get("output") or cont.status_code != 200:
            responses_lost.append(tenant)
        else:
            continued.append(tenant)
            stored[tenant + "/continued"] = cont.json()
    return {"sessions_checked": len(before), "sessions_lost": sessions_lost, "responses_checked": len(stored) - len(continued),
            "responses_lost": responses_lost}


def inject(soaked: Soaked, tenants: dict[str, str], gate: Gate, progress: "Progress", state_dir: Path,
           stored: dict[str, dict], seed: int) -> dict:
    """The faults phase's faults, at fractions of the turns done; returns
    what happened (an injection that failed says so: the soak then fails)."""
    try:
        return _inject(soaked, tenants, gate, progress, state_dir, stored, seed)
    except Exception as e:  # noqa: BLE001 - reported in the results, and the check fails on it
        return {"error": f"{type(e).__name__}: {e}"}


def _inject(soaked: Soaked, tenants: dict[str, str], gate: Gate, progress: "Progress", state_dir: Path,
            stored: dict[str, dict], seed: int) -> dict:
    done: dict = {}
    progress.wait(0.25)
    tenant = TENANTS[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Draft the weekly status report."}],
            "max_tokens": 16, "temperature": 0.0}
    done["drops"] = [drop_stream(soaked.url, key_of(tenant), {**body, "session_id": f"drop-{i}"}, i % 2 == 1)
                     for i in range(DROPS)]
    progress.wait(0.5)
    gate.close(timeout=600)
    try:
        before = snapshot(soaked, tenants)
        soaked.kill()
        corrupted = corrupt_piece(state_dir, seed)
        done["corrupted"] = str(corrupted.relative_to(state_dir)) if corrupted else None
        done["restart_s"] = soaked.start_again()
        done |= check_restart(soaked, tenants, before, stored)
    finally:
        gate.open()
    return done


class Progress:
    """Turns done so far, for faults placed at fractions of the run."""

    def __init__(self, planned: int, bar: tqdm):
        self.planned, self.bar = planned, bar
        self._done = 0
        self._cond = threading.Condition()

    def step(self) -> None:
        self.bar.update()
        with self._cond:
            self._done += 1
            self._cond.notify_all()

    def finish(self) -> None:
        """The run is over (every turn done, or some agents failed): no wait lasts."""
        with self._cond:
            self._done = max(self._done, self.planned)
            self._cond.notify_all()

    def wait(self, fraction: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._done >= fraction * self.planned)


def cleanup(soaked: Soaked, stored: dict[str, dict], hostile: bool) -> dict:
    """Delete every session and stored response of every tenant; then the pool
    must hold only what the prefix cache holds (no page leaked)."""
    for tenant in TENANTS + ((HOSTILE,) if hostile else ()):
        with http(soaked, tenant) as c:
            for s in c.get("/v1/sessions").json()["data"]:
                c.delete(f"/v1/sessions/{s['id']}")
    for name, made in stored.items():
        with http(soaked, name.split("/")[0]) as c:
            c.delete(f"/v1/responses/{made['id']}")
    m = soaked.server.metrics()
    return {"pages_used": int(m["agentkv_kv_pages_used"]), "prefix_cache_pages": int(m["agentkv_prefix_cache_pages"]),
            "leaked_pages": int(m["agentkv_kv_pages_used"] - m["agentkv_prefix_cache_pages"]),
            "pages_total": int(m["agentkv_kv_pages_total"])}


def tier_state(soaked: Soaked) -> dict:
    """The second tier as the run left it (since the last start): how full its
    disk is and what it refused, dropped, found corrupt or failed to write."""
    m = soaked.server.metrics()
    names = {"disk_errors": "agentkv_kv_tier_disk_errors_total", "tier_corrupt": "agentkv_kv_tier_corrupt_total",
             "tier_dropped": "agentkv_kv_tier_dropped_total", "tier_refused": "agentkv_kv_tier_refused_total",
             "tier_disk_bytes": "agentkv_kv_tier_disk_bytes"}
    # A save the full disk refused is a report line (the session serves on, recomputed after a restart).
    full = soaked.log.read_text(errors="replace").count("the disk tier is full")
    return {**{k: m.get(name, 0.0) for k, name in names.items()}, "saves_refused_disk_full": full}


def run_phase(phase: str, work: AgentWorkload, args: argparse.Namespace, flags: list[str], out: Path) -> dict:
    state_dir = Path(tempfile.mkdtemp(prefix=f"soak-{phase}-"))
    soaked = Soaked(args.model, flags + ["--state-dir", str(state_dir)], out / f"{phase}.log", args.threads)
    tenants = tenant_of(work.names)
    gate, hostile, faults = Gate(), None, {}
    try:
        stored = store_responses(soaked)
        if phase != "reference":
            hostile = HostileTenant(soaked.url, key_of(HOSTILE), MODEL, MAX_REQUEST_BYTES, RETAIN_S)
            hostile.start()
        planned = len(work.names) * args.turns_per_agent
        with tqdm(desc=phase, total=planned, unit="turn") as bar:
            progress = Progress(planned, bar)
            injector = threading.Thread(target=lambda: faults.update(
                inject(soaked, tenants, gate, progress, state_dir, stored, args.seed)), daemon=True)
            if phase == "faults":
                injector.start()
            records, wall = run_all(work.jobs(agent_client(soaked, tenants, gate), progress.step))
            progress.finish()
            if injector.is_alive():
                injector.join(600)
        if hostile is not None:
            hostile.stop()
        tier = tier_state(soaked)
        accounting = cleanup(soaked, stored, hostile is not None)
    finally:
        soaked.server.stop()
    turns = [t for r in records for t in r.turns if not t.error]
    return {"phase": phase, "records": records, "wall_s": wall, "statuses": {t: dict(c) for t, c in soaked.statuses.items()},
            "hostile_statuses": dict(hostile.statuses) if hostile else {}, "retries": soaked.retries,
            "turn_p50_s": statistics.median(t.latency_s for t in turns) if turns else math.nan,
            "turn_p90_s": p90([t.latency_s for t in turns]), "faults": faults, **tier, **accounting}


def compare(reference: list[AgentRecord], other: list[AgentRecord]) -> dict:
    """Turns lost (planned but not completed) and altered (a reply unlike the reference's)."""
    ref = {(r.agent, t.turn): t.text for r in reference for t in r.turns if not t.error}
    got = {(r.agent, t.turn): t.text for r in other for t in r.turns if not t.error}
    return {"turns_lost": sorted(f"{a}#{k}" for a, k in ref.keys() - got.keys()),
            "turns_altered": sorted(f"{a}#{k}" for (a, k), text in got.items() if (a, k) in ref and ref[a, k] != text),
            "errors": [e for r in other for e in r.errors]}


def flags_for(args: argparse.Namespace, work: AgentWorkload, out: Path) -> tuple[list[str], dict]:
    cfg = model_config(args.model)
    token_bytes = kv_bytes_per_token(cfg, "float32")
    budget = work.budget(Tokenizer.from_dir(args.model), args.kv_fraction, UNIT)
    if budget["longest_request_tokens"] > cfg.max_position_embeddings:
        raise SystemExit(f"the agents' longest request ({budget['longest_request_tokens']} tokens) passes the model's "
                         f"context ({cfg.max_position_embeddings}): fewer turns per agent")
    pool = budget["tokens"] * token_bytes
    disk = max(UNIT, int(budget["working_set_tokens"] * args.disk_fraction)) * token_bytes
    keys = out / "keys.txt"
    keys.write_text("".join(f"{key_of(t)} {t}\n" for t in TENANTS + (HOSTILE,)))
    flags = ["--served-model-name", MODEL, "--api-keys-file", str(keys), "--public-metrics",
             "--kv-cache-gb", repr(pool / 2**30), "--kv-offload-gb", repr(pool / 2**30),
             "--kv-offload-disk-gb", repr(disk / 2**30), "--max-request-bytes", str(MAX_REQUEST_BYTES),
             "--max-retain-seconds", str(RETAIN_S), "--tenant-max-sessions", str(args.tenant_max_sessions),
             # A well-behaved tenant's agents all in flight at once stay within its quota, beside the streams its
             # client drops: a dropped request holds its slot until the server reaps it (within a step, seconds
             # in a long prefill), and the drops come one after another. The hostile tenant's few threads are far
             # below the quota: what it may do is what any tenant may.
             "--tenant-max-concurrent", str(-(-args.agents // len(TENANTS)) + DROPS + 1)]
    return flags, {**budget, "token_bytes": token_bytes, "pool_bytes": pool, "host_tier_bytes": pool, "disk_bytes": disk}


def plot(res: dict, path: Path) -> None:
    """Each phase's turn latencies, sorted (a CDF per phase)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in res["phases"]:
        xs = sorted(t["latency_s"] for r in row["records"] for t in r["turns"] if not t["error"])
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=row["phase"])
    ax.set_xlabel("turn latency (s), well-behaved tenants")
    ax.set_ylabel("fraction of turns")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


HEADERS = ["phase", "turns done", "lost", "altered", "errors", "5xx (them)", "5xx (hostile)", "hostile 4xx",
           "turn p50 s", "turn p90 s", "p90 / reference", "leaked pages", "retries"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="the CI form: 6 agents, 2 turns, short replies and pauses")
    p.add_argument("--agents", type=int, default=32)
    p.add_argument("--turns-per-agent", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--pause-scale", type=float, default=1.0)
    p.add_argument("--kv-fraction", type=float, default=1 / 3, help="the pool over the agents' working set")
    p.add_argument("--disk-fraction", type=float, default=0.05,
                   help="the disk tier's cap over the working set (small: it fills)")
    p.add_argument("--tenant-max-sessions", type=int, default=64)
    p.add_argument("--model", type=Path, default=SMALL_MODEL_DIR,
                   help="default: the 8M model, whose 16k context holds the agents' longest turns (the 135M "
                        "default model's 8k does not past their first turn); what is soaked is the server")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--no-wandb", action="store_true")
    args = p.parse_args(argv)
    if args.short:
        args.agents, args.turns_per_agent, args.max_tokens, args.pause_scale = 6, 2, 8, 0.05
        args.kv_fraction = 0.5
    out = run_dir("soak", args.out)
    args.model = hf_checkpoint(args.model, "float32")
    work = AgentWorkload("generated", args.agents, args.turns_per_agent, args.seed, args.max_tokens,
                         Pauses(args.seed, args.pause_scale))
    flags, budget = flags_for(args, work, out)
    phases = [run_phase(phase, work, args, flags, out) for phase in PHASES]
    reference = phases[0]
    for row in phases:
        row |= compare(reference["records"], row["records"])
    rows = []
    for row in phases:
        row["p90_over_reference"] = row["turn_p90_s"] / reference["turn_p90_s"]
        five = sum(n for c in row["statuses"].values() for s, n in c.items() if s >= 500)
        hostile5 = sum(n for s, n in row["hostile_statuses"].items() if s >= 500)
        hostile4 = sum(n for s, n in row["hostile_statuses"].items() if 400 <= s < 500)
        done = sum(1 for r in row["records"] for t in r.turns if not t.error)
        row |= {"server_errors": five, "hostile_server_errors": hostile5, "turns_done": done}
        rows.append([row["phase"], done, len(row["turns_lost"]), len(row["turns_altered"]), len(row["errors"]), five,
                     hostile5, hostile4, f"{row['turn_p50_s']:.2f}", f"{row['turn_p90_s']:.2f}",
                     f"{row['p90_over_reference']:.2f}", row["leaked_pages"], row["retries"]])
        row["records"] = records_json(row["records"])
    faults = phases[-1]["faults"]
    res = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "machine": machine(),
           "budget": budget, "phases": phases, "out_dir": str(out)}
    lines = [f"{args.agents} agents of tenants {', '.join(TENANTS)} (well-behaved) beside {HOSTILE} (hostile), "
             f"{args.turns_per_agent} turns each; KV pool {budget['tokens']} tokens "
             f"({budget['tokens'] / budget['working_set_tokens']:.0%} of a working set of {budget['working_set_tokens']}), "
             f"a host tier as large, a disk tier of {budget['disk_bytes'] / 2**20:.1f} MiB",
             table(HEADERS, rows),
             f"faults: streams dropped {faults.get('drops')}, KV piece corrupted: {faults.get('corrupted')}, "
             f"restart {faults.get('restart_s', math.nan):.1f} s; after it {faults.get('sessions_checked', 0)} sessions "
             f"checked, lost {faults.get('sessions_lost')}; {faults.get('responses_checked', 0)} stored responses, "
             f"lost {faults.get('responses_lost')}",
             f"tier after the faults phase: corrupt pieces found {phases[-1]['tier_corrupt']:.0f}, disk errors "
             f"{phases[-1]['disk_errors']:.0f}, entries dropped for room {phases[-1]['tier_dropped']:.0f}, offloads "
             f"refused for room {phases[-1]['tier_refused']:.0f}, session saves refused by the full disk "
             f"{phases[-1]['saves_refused_disk_full']}, disk held {phases[-1]['tier_disk_bytes'] / 2**20:.1f} of "
             f"{budget['disk_bytes'] / 2**20:.1f} MiB at the end"]
    summary = {f"{r['phase']}/{k}": r[k] for r in phases
               for k in ("turn_p90_s", "p90_over_reference", "server_errors", "leaked_pages")}
    wandb = None if args.no_wandb else WandbRun("soak", res["args"], summary, tables={"phases": (HEADERS, rows)})
    publish(out, res, "\n".join(lines), plots={"soak.png": plot}, wandb=wandb)
    return res


if __name__ == "__main__":
    main()
