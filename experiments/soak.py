"""Fault-injection soak against the real server (issues 42, 56): well-behaved
agents of three tenants run their jobs while a fourth tenant is hostile and
the server is hurt under their own turns, and every turn they complete must
be the turn a run with no faults completes.

    python -m agentkv.experiments.soak            # 32 agents, 6 turns each, 4 tenants (times: docs/soak.md)
    python -m agentkv.experiments.soak --short    # the CI form (tests/test_soak_smoke.py): 6 agents, 3 turns

Three phases, each on a fresh server with the same flags (API keys for four
tenants, a state directory, a KV pool at --kv-fraction of the agents'
working set, a host tier as large, and the tier's disk a tmpfs of
--disk-fraction of it, mounted for the phase, under a cap it never
reaches, so that its writes fail with ENOSPC as on a disk that filled):
1. reference: the well-behaved agents alone;
2. hostile: the same agents beside the hostile tenant at its full quotas
   (experiments/workloads/hostile.py: its concurrency cap, bodies at the
   size limit, pathological tool schemas, session churn, pins, floods);
3. faults: the hostile tenant again, some of the agents' own streams dropped
   mid-reply (each such turn's first try), and the server SIGKILLed several
   times while an agent's turn is mid-prefill (sent, no first token yet,
   /metrics showing a request running) or mid-decode (streaming), each time
   restarted on the same state directory (after the first kill, a saved KV
   piece corrupted too).
The agents are the generated workflows (experiments/workloads/agent_runs),
each in a named session of its tenant, greedy, streamed, through
experiments/drivers/soak_client.py: a turn cut off is sent again, at most
--tries times within --turn-deadline seconds, and around every turn the
client holds the session (GET /v1/sessions/{id}) to the turns it saw
completed, and a cut-off turn to absent or whole. Each tenant also stores a
Responses API response before the faults and continues it after them.

Checks (the CI form asserts them): every turn of phases 2 and 3 equals the
reference's, no 5xx to any tenant, no turn lost, half-written or given up,
no session lost, every kill landed at its point, the tier's disk full
(ENOSPC counted), every stored response read back and continued, and after
each phase, with every session and response deleted, the pool holds nothing
but the prefix cache. Reported, not asserted: the hostile tenant's effect
on the others' p90 turn latency (phase 2 over phase 1; the target is at most 1.5x).
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from agentkv.experiments.benchmarks.bench_agents import hf_checkpoint, kv_bytes_per_token, model_config
from agentkv.experiments.common import machine, run_dir
from agentkv.experiments.drivers.faults import corrupt_piece, kill, small_disk
from agentkv.experiments.drivers.servers import ServerProcess, free_port, start_engine_server
from agentkv.experiments.drivers.soak_client import AgentClient, InFlight, RetryPolicy, Tally, Watch
from agentkv.experiments.report import WandbRun, publish, pyplot, save_figure, table
from agentkv.experiments.workloads.agent_runs import AgentRecord, Pauses, p90, records_json, run_all
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
SERVER_DOWN_S = 300.0  # how long anyone waits for a killed server to come back
PREFILL_AFTER_S = 0.1  # a request this long without its first token is in its prefill (or queued: /metrics says)
KILL_WAIT_S = 120.0  # how long a kill waits for a request at its point before it is reported missed


def key_of(tenant: str) -> str:
    return f"sk-soak-{tenant}-0123456789"


class Soaked:
    """One phase's server, restartable on its port and state directory."""

    def __init__(self, model: Path, flags: list[str], log: Path, threads: int):
        self.model, self.flags, self.log, self.threads = model, flags, log, threads
        self.port = free_port()
        self.server = self._start()

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

    def wait_up(self, deadline: float) -> None:
        """Until the server answers /health, or TimeoutError at deadline (time.monotonic())."""
        deadline = min(deadline, time.monotonic() + SERVER_DOWN_S)
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the server did not come back in time")


def tenant_of(names: list[str]) -> dict[str, str]:
    return {agent: TENANTS[i % len(TENANTS)] for i, agent in enumerate(names)}


def http(soaked: Soaked, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=soaked.url, headers={"Authorization": f"Bearer {key_of(tenant)}"}, timeout=600)


def store_responses(soaked: Soaked, tally: Tally) -> dict[str, dict]:
    """One stored Responses API response per well-behaved tenant: tenant -> its JSON."""
    out = {}
    for tenant in TENANTS:
        with http(soaked, tenant) as c:
            r = c.post("/v1/responses", json={"model": MODEL, "input": f"Summarize the {tenant} backlog.",
                                               "max_output_tokens": 6, "temperature": 0.0})
        tally.count(tenant, r.status_code)
        r.raise_for_status()
        out[tenant] = r.json()
    return out


def check_responses(soaked: Soaked, stored: dict[str, dict], tally: Tally) -> dict:
    """Each stored response read back unchanged and continued (after the faults, if any)."""
    lost = []
    for tenant, made in list(stored.items()):
        with http(soaked, tenant) as c:
            got = c.get(f"/v1/responses/{made['id']}")
            cont = c.post("/v1/responses", json={"model": MODEL, "input": "And the next step?", "max_output_tokens": 4,
                                                 "temperature": 0.0, "previous_response_id": made["id"]})
        for r in (got, cont):
            tally.count(tenant, r.status_code)
        if got.status_code != 200 or got.json().get("output") != made.get("output") or cont.status_code != 200:
            lost.append(tenant)
        else:
            stored[tenant + "/continued"] = cont.json()
    return {"responses_checked": len(TENANTS), "responses_lost": lost}


def at_point(point: str):
    """A Watch picker: an agent's request mid-prefill (the longest waiting
    for its first token) or mid-decode (the one furthest into its stream)."""
    def pick(now: list[InFlight]) -> InFlight | None:
        t = time.monotonic()
        if point == "prefill":
            waiting = [f for f in now if f.first_token is None and t - f.sent >= PREFILL_AFTER_S]
            return max(waiting, key=lambda f: t - f.sent, default=None)
        return max((f for f in now if f.first_token is not None), key=lambda f: f.deltas, default=None)
    return pick


def find_target(soaked: Soaked, watch: Watch, point: str) -> tuple[InFlight | None, float | None]:
    """An agent's request at the point, within KILL_WAIT_S (None if none came),
    and for a prefill, how many requests /metrics said were running: one at
    least, so that the engine is computing a prompt, not only queueing."""
    pick, end = at_point(point), time.monotonic() + KILL_WAIT_S
    while (left := end - time.monotonic()) > 0:
        hit = watch.wait_for(pick, left)
        if hit is None or point == "decode":
            return hit, None
        running = soaked.server.metrics().get("vllm:num_requests_running", 0.0)
        if running >= 1 and (hit := watch.wait_for(pick, 0)) is not None:  # still without its first token now
            return hit, running
        time.sleep(0.05)
    return None, None


def inject(soaked: Soaked, watch: Watch, progress: "Progress", kv_dir: Path, plan: list[tuple[float, str]],
           seed: int) -> dict:
    """The kills, each at its fraction of the turns done, once an agent's
    request is at its point; after the first, a saved KV piece corrupted.
    Returns what happened (an injection that failed says so: the soak then fails)."""
    kills: list[dict] = []
    out: dict = {"kills": kills}
    try:
        for i, (fraction, point) in enumerate(plan):
            progress.wait(fraction)
            hit, running = find_target(soaked, watch, point)
            if hit is None:
                kills.append({"point": point, "missed": True})
                continue
            # Looked up before the signal: once it lands, the client ends the request at once.
            cut = watch.current(hit.agent)
            soaked.kill()
            kills.append({"point": point, "agent": hit.agent, "turn": hit.turn, "running": running,
                          "in_flight_s": round(time.monotonic() - hit.sent, 3), "streamed_chunks": hit.deltas,
                          "cut": cut is not None and cut.sent == hit.sent})
            if i == 0:
                corrupted = corrupt_piece(kv_dir, seed)
                out["corrupted"] = str(corrupted.relative_to(kv_dir)) if corrupted else None
            kills[-1]["restart_s"] = soaked.start_again()
    except Exception as e:  # noqa: BLE001 - reported in the results, and the check fails on it
        out["error"] = f"{type(e).__name__}: {e}"
    return out


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
    """The second tier as the run left it: from its counters since the last
    start, how full its disk is and what it dropped, refused or found
    corrupt; from the log (every start), the writes the full disk failed."""
    m = soaked.server.metrics()
    names = {"tier_corrupt": "agentkv_kv_tier_corrupt_total", "tier_dropped": "agentkv_kv_tier_dropped_total",
             "tier_refused": "agentkv_kv_tier_refused_total", "tier_disk_bytes": "agentkv_kv_tier_disk_bytes"}
    text = soaked.log.read_text(errors="replace")
    return {**{k: m.get(name, 0.0) for k, name in names.items()}, "enospc": text.count("No space left on device"),
            "corrupt_found": text.count("checksum")}


def plan_faults(args: argparse.Namespace, work: AgentWorkload) -> tuple[list[tuple[float, str]], set[tuple[str, int]]]:
    """The kills (at evenly spaced fractions of the turns done) and the
    (agent, turn) pairs whose stream is dropped, drawn by the seed."""
    points = args.kills.split(",")
    plan = [((i + 1) / (len(points) + 1), point) for i, point in enumerate(points)]
    pairs = [(a, t) for a in work.names for t in range(args.turns_per_agent)]
    return plan, set(random.Random(args.seed).sample(pairs, min(args.drops, len(pairs))))


def run_phase(phase: str, work: AgentWorkload, args: argparse.Namespace, flags: list[str], budget: dict,
              out: Path) -> dict:
    state_dir = Path(tempfile.mkdtemp(prefix=f"soak-{phase}-"))
    with small_disk(state_dir.with_name(state_dir.name + "-kv"), budget["disk_bytes"]) as kv_dir:
        soaked = Soaked(args.model, flags + ["--state-dir", str(state_dir), "--kv-offload-dir", str(kv_dir)],
                        out / f"{phase}.log", args.threads)
        try:
            return _run_phase(phase, work, args, soaked, kv_dir)
        finally:
            soaked.server.stop()


def _run_phase(phase: str, work: AgentWorkload, args: argparse.Namespace, soaked: Soaked, kv_dir: Path) -> dict:
    tenants, tally, watch = tenant_of(work.names), Tally(), Watch()
    plan, drops = plan_faults(args, work) if phase == "faults" else ([], set())
    client = AgentClient(lambda: soaked.url, soaked.wait_up, tenants, key_of, MODEL,
                         RetryPolicy(args.tries, args.turn_deadline), watch, tally, drops)
    stored = store_responses(soaked, tally)
    hostile = None
    if phase != "reference":
        hostile = HostileTenant(soaked.url, key_of(HOSTILE), MODEL, MAX_REQUEST_BYTES, RETAIN_S,
                                threads=args.tenant_max_concurrent)
        hostile.start()
    planned = len(work.names) * args.turns_per_agent
    faults: dict = {}
    with tqdm(desc=phase, total=planned, unit="turn") as bar:
        progress = Progress(planned, bar)
        injector = threading.Thread(target=lambda: faults.update(
            inject(soaked, watch, progress, kv_dir, plan, args.seed)), daemon=True)
        injector.start()
        records, wall = run_all(work.jobs(client, progress.step))
        progress.finish()
        injector.join(SERVER_DOWN_S)
    if hostile is not None:
        hostile.stop()
    for agent in work.names:
        client.settle(agent)
    faults |= {"drops_planned": len(drops), **check_responses(soaked, stored, tally)}
    tier = tier_state(soaked)
    accounting = cleanup(soaked, stored, hostile is not None)
    turns = [t for r in records for t in r.turns if not t.error]
    return {"phase": phase, "records": records, "wall_s": wall, **tally.as_json(),
            "hostile_statuses": dict(hostile.statuses) if hostile else {},
            "hostile_moves": dict(hostile.moves) if hostile else {},
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
             # The tier's cap is the whole working set: what stops its writes is the small disk under it (ENOSPC).
             "--kv-offload-disk-gb", repr(budget["working_set_tokens"] * token_bytes / 2**30),
             "--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-retain-seconds", str(RETAIN_S),
             "--tenant-max-sessions", str(args.tenant_max_sessions),
             "--tenant-max-concurrent", str(args.tenant_max_concurrent)]
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
           "turn p50 s", "turn p90 s", "p90 / reference", "leaked pages", "retries", "cut off", "absent / whole / half",
           "ENOSPC"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="the CI form: 6 agents, 3 turns, short replies and pauses")
    p.add_argument("--agents", type=int, default=32)
    p.add_argument("--turns-per-agent", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--pause-scale", type=float, default=1.0)
    p.add_argument("--kv-fraction", type=float, default=1 / 3, help="the pool over the agents' working set")
    p.add_argument("--disk-fraction", type=float, default=0.05,
                   help="the tier's disk (a tmpfs) over the working set (small: it fills)")
    p.add_argument("--kills", default="prefill,decode,prefill,decode",
                   help="the faults phase's SIGKILLs, in order, each at a request mid-prefill or mid-decode")
    p.add_argument("--drops", type=int, default=8, help="agents' turns whose first try hangs up mid-reply")
    p.add_argument("--tries", type=int, default=6, help="requests per turn at most, the first included")
    p.add_argument("--turn-deadline", type=float, default=900.0, help="seconds a turn may take, its retries included")
    p.add_argument("--tenant-max-sessions", type=int, default=64)
    p.add_argument("--tenant-max-concurrent", type=int, default=None,
                   help="every tenant's concurrency quota, the hostile tenant's threads (default: a well-behaved "
                        "tenant's agents + 2)")
    p.add_argument("--model", type=Path, default=SMALL_MODEL_DIR,
                   help="default: the 8M model, whose 16k context holds the agents' longest turns (the 135M "
                        "default model's 8k does not past their first turn); what is soaked is the server")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--no-wandb", action="store_true")
    args = p.parse_args(argv)
    if args.short:
        args.agents, args.turns_per_agent, args.max_tokens, args.pause_scale = 6, 3, 12, 0.05
        args.kv_fraction, args.kills, args.drops, args.turn_deadline = 0.5, "prefill,decode,prefill", 3, 240.0
    # A dropped turn's retry waits until the server has reaped it, but its slot may be freed a moment later.
    args.tenant_max_concurrent = args.tenant_max_concurrent or -(-args.agents // len(TENANTS)) + 2
    out = run_dir("soak", args.out)
    args.model = hf_checkpoint(args.model, "float32")
    work = AgentWorkload("generated", args.agents, args.turns_per_agent, args.seed, args.max_tokens,
                         Pauses(args.seed, args.pause_scale))
    flags, budget = flags_for(args, work, out)
    phases = [run_phase(phase, work, args, flags, budget, out) for phase in PHASES]
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
        rows.append([row["phase"], done, len(row["turns_lost"]) + len(row["turns_missing"]), len(row["turns_altered"]),
                     len(row["errors"]), five, hostile5, hostile4, f"{row['turn_p50_s']:.2f}", f"{row['turn_p90_s']:.2f}",
                     f"{row['p90_over_reference']:.2f}", row["leaked_pages"], row["retries"], sum(row["cut_off"].values()),
                     f"{row['absent']} / {row['complete']} / {len(row['half_written'])}", row["enospc"]])
        row["records"] = records_json(row["records"])
    faults = phases[-1]["faults"]
    res = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "machine": machine(),
           "budget": budget, "phases": phases, "out_dir": str(out)}
    kills = "; ".join(f"{k['point']}: missed" if k.get("missed") else
                      f"{k['point']}: {k['agent']}#{k['turn']} {k['in_flight_s']:.2f} s in, {k['streamed_chunks']} "
                      f"chunks, running {k['running']}, cut {k['cut']}, restart {k['restart_s']:.1f} s"
                      for k in faults.get("kills", []))
    last = phases[-1]
    lines = [f"{args.agents} agents of tenants {', '.join(TENANTS)} (well-behaved) beside {HOSTILE} (hostile, "
             f"{args.tenant_max_concurrent} threads: its concurrency quota), {args.turns_per_agent} turns each; KV pool "
             f"{budget['tokens']} tokens ({budget['tokens'] / budget['working_set_tokens']:.0%} of a working set of "
             f"{budget['working_set_tokens']}), a host tier as large, the tier's disk a tmpfs of "
             f"{budget['disk_bytes'] / 2**20:.1f} MiB; at most {args.tries} tries and {args.turn_deadline:.0f} s a turn",
             table(HEADERS, rows),
             f"kills: {kills}; error: {faults.get('error')}",
             f"streams dropped mid-reply (agents' own turns): {last['cut_off'].get('dropped', 0)} of "
             f"{faults.get('drops_planned')} planned; KV piece corrupted: {faults.get('corrupted')}; stored responses "
             f"lost after the faults: {faults.get('responses_lost')} of {faults.get('responses_checked')}",
             f"cut-off turns: {last['absent']} absent, {last['complete']} whole, half-written {last['half_written']}; "
             f"turns seen completed then missing {last['turns_missing']}, recorded unseen {last['turns_extra']}, "
             f"sessions lost {last['sessions_lost']}, turns given up {last['gave_up']}, stream errors "
             f"{last['stream_errors']}",
             f"tier after the faults phase: ENOSPC writes {last['enospc']}, corrupt pieces found "
             f"{last['tier_corrupt']:.0f} (since the last start), entries dropped for room {last['tier_dropped']:.0f}, "
             f"disk held {last['tier_disk_bytes'] / 2**20:.1f} of {budget['disk_bytes'] / 2**20:.1f} MiB at the end",
             f"hostile moves (faults phase): {last['hostile_moves']}"]
    summary = {f"{r['phase']}/{k}": r[k] for r in phases
               for k in ("turn_p90_s", "p90_over_reference", "server_errors", "leaked_pages")}
    wandb = None if args.no_wandb else WandbRun("soak", res["args"], summary, tables={"phases": (HEADERS, rows)})
    publish(out, res, "\n".join(lines), plots={"soak.png": plot}, wandb=wandb)
    return res


if __name__ == "__main__":
    main()
