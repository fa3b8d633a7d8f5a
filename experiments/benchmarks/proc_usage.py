"""Who used the CPUs while a benchmark timed something: the timed process's
own CPU time, faults and involuntary context switches, the CPU time of the
other processes the benchmark started, and the rest of the machine's (other
users, kernel threads) and the hypervisor's steal, read from /proc before
and after (Linux only; elsewhere every figure is None).

A timed interval is clean when the timed process ran for its whole wall
time on its threads (cpu_per_wall near the thread count), was seldom
preempted (few involuntary switches) and nothing else held a core
(others_cores and foreign_cores near 0, steal_share near 0)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcTicks:
    """One process: CPU ticks (all threads), faults, involuntary switches (all threads)."""

    cpu: int
    minflt: int
    majflt: int
    nonvoluntary: int


def proc_ticks(pid: int) -> ProcTicks | None:
    """None when the process is gone or /proc is not there."""
    try:
        # The command name (field 2) may hold spaces: split after its closing parenthesis.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        switches = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            for line in (task / "status").read_text().splitlines():
                if line.startswith("nonvoluntary_ctxt_switches:"):
                    switches += int(line.split()[1])
    except (OSError, IndexError, ValueError):
        return None
    # Fields after the name, 0-based from state: minflt 7, majflt 9, utime 11, stime 12.
    return ProcTicks(int(fields[11]) + int(fields[12]), int(fields[7]), int(fields[9]), switches)


def machine_ticks() -> tuple[int, int] | None:
    """The whole machine's busy ticks (everything but idle and iowait; steal
    excluded) and steal ticks, summed over the CPUs."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def vcpu_ticks() -> dict[int, int] | None:
    """Busy ticks per vCPU (as machine_ticks counts them): which vCPU did the work."""
    out = {}
    try:
        for line in Path("/proc/stat").read_text().splitlines()[1:]:
            if not line.startswith("cpu"):
                break
            name, *v = line.split()
            user, nice, system, _idle, _iowait, irq, softirq = ([int(x) for x in v] + [0] * 7)[:7]
            out[int(name[3:])] = user + nice + system + irq + softirq
    except (OSError, ValueError):
        return None
    return out


@dataclass(frozen=True)
class Snapshot:
    timed: ProcTicks | None
    others: dict[int, ProcTicks | None]
    machine: tuple[int, int] | None
    vcpus: dict[int, int] | None = None


def snapshot(timed_pid: int, other_pids: list[int]) -> Snapshot:
    return Snapshot(proc_ticks(timed_pid), {p: proc_ticks(p) for p in other_pids}, machine_ticks(), vcpu_ticks())


def usage(before: Snapshot, after: Snapshot, wall_s: float) -> dict:
    """What happened between two snapshots over wall_s seconds: cpu_per_wall
    (the timed process's CPU seconds per second), its faults and involuntary
    switches, others_cores (the other started processes' CPU seconds per
    second), foreign_cores (the rest of the machine's), steal_share
    (steal per second, in cores) and vcpu_busy (each vCPU's busy share, by id)."""
    out: dict = dict.fromkeys(("cpu_per_wall", "minflt", "majflt", "nonvoluntary", "others_cores", "foreign_cores",
                               "steal_share", "vcpu_busy"))
    if wall_s <= 0:
        return out
    seconds = 1.0 / TICK / wall_s
    own = 0
    if before.timed and after.timed:
        own = after.timed.cpu - before.timed.cpu
        out.update(cpu_per_wall=own * seconds, minflt=after.timed.minflt - before.timed.minflt,
                   majflt=after.timed.majflt - before.timed.majflt,
                   nonvoluntary=after.timed.nonvoluntary - before.timed.nonvoluntary)
    others = sum(after.others[p].cpu - b.cpu for p, b in before.others.items()
                 if b is not None and after.others.get(p) is not None)
    out["others_cores"] = others * seconds
    if before.machine and after.machine:
        busy = after.machine[0] - before.machine[0]
        # Tick sampling can put the machine a tick behind the processes: never below zero.
        out["foreign_cores"] = max(0, busy - own - others) * seconds
        out["steal_share"] = (after.machine[1] - before.machine[1]) * seconds
    if before.vcpus and after.vcpus:
        out["vcpu_busy"] = {c: (after.vcpus[c] - t) * seconds for c, t in before.vcpus.items() if c in after.vcpus}
    return out


def wait_quiet(pids: list[int], max_cores: float, window_s: float = 0.5, timeout_s: float = 10.0) -> float:
    """Waits until, over one window_s, the processes outside pids used at most
    max_cores of the machine (the benchmark's own processes may run), or
    timeout_s passes; returns the seconds waited. Without /proc it returns at once."""
    start = time.perf_counter()
    while True:
        before = snapshot(pids[0], pids[1:])
        if before.machine is None:
            return 0.0
        time.sleep(window_s)
        foreign = usage(before, snapshot(pids[0], pids[1:]), window_s)["foreign_cores"]
        waited = time.perf_counter() - start
        if foreign is None or foreign <= max_cores or waited >= timeout_s:
            return waited
