"""A peer in its own virtual environment, served turn by turn over JSON
lines by a driver script (experiments/drivers/peers/*_driver.py, protocol in
experiments/drivers/peers/peer_protocol.py); its stderr goes to a log file."""
from __future__ import annotations

import json
import select
import subprocess
import time
from pathlib import Path

from agentkv.experiments.drivers.system import PEER_CWD, Request, turn_row


class PeerSystem:
    def __init__(self, kind: str, cmd: list[str], env: dict, spec: dict, log: Path, timeout: float | None):
        """Starts the driver and sends it spec; returns once it is loaded and
        warmed up. timeout: seconds a turn may take before the peer is killed."""
        self.name, self.timeout = kind, timeout
        self.logf = open(log, "a")
        self.logf.write(f"\n=== {kind}: {' '.join(cmd)}\n")
        self.logf.flush()
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.logf, text=True, cwd=PEER_CWD, bufsize=1)
        start = time.perf_counter()
        self.info = self._call(spec, timeout=None)
        self.info["startup_s"] = time.perf_counter() - start
        if not self.info.get("ready"):
            raise RuntimeError(f"{kind} did not start: {self.info}")

    def _call(self, msg: dict, timeout: float | None = -1.0) -> dict:
        timeout = self.timeout if timeout == -1.0 else timeout
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        if timeout is not None:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if not ready:
                self.proc.kill()
                raise TimeoutError(f"{self.name} gave no answer in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited with {self.proc.wait()}; see {self.logf.name}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"{self.name}: {out['error']}")
        return out

    def begin(self) -> None:
        self._call({"op": "begin"})

    def turn(self, r: Request) -> dict:
        t = self._call({"op": "turn", "ids": r.ids, "gen": r.gen, "agent": r.agent})
        reused = t.get("cached_tokens", t.get("reused", 0))
        return turn_row(t["latency_s"], t["prefill_s"], t["decode_s"], len(r.ids) - reused, reused,
                        t["generated"], token_ids=t.get("token_ids"))

    def decode(self, ids: list[int], gen: int, agent: str) -> dict:
        """One request of exactly gen greedy tokens with per-token arrival
        times: the driver's answer, whose token_s holds each token's seconds
        from the call's start (experiments.benchmarks.bench_decode)."""
        return self._call({"op": "decode", "ids": ids, "gen": gen, "agent": agent})

    def end(self) -> None:
        """Nothing to do: the driver drops its caches at the next begin."""

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self._call({"op": "quit"}, timeout=60)
                self.proc.wait(timeout=60)
        except Exception:  # noqa: BLE001 - a peer that will not quit is killed
            self.proc.kill()
        self.logf.close()
