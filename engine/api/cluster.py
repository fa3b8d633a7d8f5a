"""Several engine processes behind vllm-router, started and stopped as one:

    python serve.py cluster --replicas 2 --state-dir ./state [--port 8000] \\
        [--policy consistent_hash] [--threads 1] [any serve.py flag, passed to every replica]

Each replica is `serve.py --state-dir DIR --shared-state` on 127.0.0.1
(ports --port+1, +2, ...; OMP_NUM_THREADS --threads, by default the cores
shared out), the router (vllm-router, a Rust binary from PyPI: `pip
install '.[cluster]'`; its own Prometheus metrics on the port after the
replicas') has the replicas as its workers, and clients talk to it as to
one server through --host:--port.

- The public port: vllm-router serves its worker management (/add_worker,
  /remove_worker, /list_workers, /workers, /flush_cache, ...) on the port it
  routes on, with no authentication and no option to move it. So the router
  listens on 127.0.0.1 only (the port after its metrics'), where the watcher
  and drain below manage its workers, and --host:--port is a reverse proxy
  in this process (engine.api.router_proxy) that forwards the replicas'
  client API (their /v1/... routes, /health, /metrics), headers, streams and
  statuses intact, and answers any other path 404.

- Affinity: with --policy consistent_hash (the default) the router hashes a
  request's X-Session-Id header (its first choice of key) onto a ring of the
  replicas, so every turn of a session lands on the replica holding its KV.
  A Responses API continuation lands with its conversation when the client
  sends one X-Session-Id for it (any replica can serve it regardless, below).
  Requests without a session are placed by a hash of their body.
  --policy cache_aware places every request by the router's approximate
  prefix tree of what each replica was sent (prefix-aware, but agents that
  share a long system prompt all match one replica); round_robin is the
  ablation.
- Failover: the replicas share the state directory and its disk tier of KV.
  Every session is saved at the end of each turn (its KV written through,
  then its record), so when a replica dies its sessions continue on the one
  the ring names next, which takes each up from its record and restores its
  KV from disk, recomputing only what was not saved (the reply's last
  token). The watcher here removes a replica that exited from the router at
  once; the router's health check (every second) is the backstop.
- Drain (Cluster.drain): one replica leaves the router, then finishes its
  requests in flight and exits; its sessions continue on the others from
  their saved records, as after a failure but with nothing lost.
- Shutdown (SIGTERM, SIGINT): the public proxy stops first, so no new
  request arrives (those in flight get a few seconds to end), then the
  router, then every replica gets SIGTERM and drains its requests in flight
  (their sessions are saved as each ends) before it exits.

Start-up fails with a ClusterError that says why: the router is not
installed (RouterMissingError), a replica or the router exited or did not
answer /health in time (StartError, with the tail of its log), the public
port cannot be had (StartError).
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from agentkv.engine.api.router_proxy import ProxyStartError, RouterProxy

log = logging.getLogger("agentkv.cluster")

POLICIES = ("consistent_hash", "cache_aware", "round_robin")
ROOT = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 60.0  # a replica's drain (serve.py waits up to 30 s for requests in flight) and its exit
PROXY_STOP_TIMEOUT_S = 10.0  # requests in flight through the proxy get 8 s (RouterProxy.graceful_timeout) to end


class ClusterError(RuntimeError):
    pass


class RouterMissingError(ClusterError):
    pass


class StartError(ClusterError):
    pass


def router_available() -> bool:
    return importlib.util.find_spec("vllm_router") is not None


class _Process:
    """A child in its own process group (so that a signal reaches what it spawns), its output in log."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str]):
        self.name, self.log_path = name, log_path
        self._logf = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=self._logf,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float) -> None:
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait()
        self._logf.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Cluster:
    """N replicas, the router and the public proxy; start() returns once all answer /health.
    url is the public one (the proxy's), router_url the router's own on loopback (its admin API too)."""

    def __init__(self, replicas: int, state_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8000,
                 replica_ports: list[int] | None = None, metrics_port: int | None = None,
                 router_port: int | None = None, policy: str = "consistent_hash", threads: int | None = None,
                 serve_args: list[str] = (), startup_timeout: float = 300.0, log_dir: str | Path | None = None):
        if replicas < 1:
            raise ValueError("a cluster needs at least one replica")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
        self.state_dir = Path(state_dir)
        self.host, self.port, self.policy = host, port, policy
        self.ports = list(replica_ports or [port + 1 + i for i in range(replicas)])
        if len(self.ports) != replicas:
            raise ValueError(f"{replicas} replicas need {replicas} ports, got {len(self.ports)}")
        self.metrics_port = metrics_port or port + 1 + replicas  # the router's own /metrics
        self.router_port = router_port or port + 2 + replicas  # the router itself, on loopback
        self.threads = threads or max(1, (os.cpu_count() or 1) // replicas)
        self.serve_args, self.startup_timeout = list(serve_args), startup_timeout
        self.log_dir = Path(log_dir) if log_dir is not None else self.state_dir / "logs"
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        self.router_url = f"http://127.0.0.1:{self.router_port}"
        self.replica_urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.replicas: list[_Process] = []
        self.router: _Process | None = None
        self.proxy: RouterProxy | None = None
        self._removed: set[int] = set()
        self._stopping = threading.Event()

    def start(self) -> "Cluster":
        if self.replicas:  # a second start would orphan the first router and replicas
            raise ClusterError("this cluster was already started")
        if not router_available():
            raise RouterMissingError("the router is not installed: pip install '.[cluster]' (vllm-router from PyPI)")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for i, port in enumerate(self.ports):
                self.replicas.append(self._replica(i, port))
            for p, url in zip(self.replicas, self.replica_urls):
                self._wait(p, url)
            self.router = self._router()
            self._wait(self.router, self.router_url)
            self.proxy = RouterProxy(self.router_url, self.host, self.port)
            try:
                self.proxy.start()
            except ProxyStartError as e:
                raise StartError(f"the public proxy did not start: {e}") from e
        except BaseException:
            self.stop()
            raise
        threading.Thread(target=self._watch, name="agentkv-cluster-watch", daemon=True).start()
        log.info("%d replicas behind vllm-router (%s) on %s", len(self.replicas), self.policy, self.url)
        return self

    def _replica(self, i: int, port: int) -> _Process:
        cmd = [sys.executable, "-m", "agentkv.serve", "--host", "127.0.0.1", "--port", str(port),
               "--state-dir", str(self.state_dir), "--shared-state", *self.serve_args]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        return _Process(f"replica {i}", cmd, self.log_dir / f"replica-{i}.log", env)

    def _router(self) -> _Process:
        # Loopback only: its admin API has no authentication (the proxy serves the public port).
        cmd = [sys.executable, "-m", "vllm_router.launch_router",
               "--host", "127.0.0.1", "--port", str(self.router_port),
               "--worker-urls", *self.replica_urls, "--policy", self.policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
               # A replica that died is out of the ring within a second even if the watcher missed it.
               "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               "--worker-startup-timeout-secs", str(int(self.startup_timeout)), "--log-level", "warning"]
        return _Process("router", cmd, self.log_dir / "router.log", dict(os.environ))

    def _wait(self, p: _Process, url: str) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while not _healthy(url):
            if not p.alive():
                raise StartError(f"{p.name} exited with {p.proc.returncode} before it was ready; "
                                 f"{p.log_path}:\n{p.tail()}")
            if time.monotonic() > deadline:
                raise StartError(f"{p.name} did not answer {url}/health within {self.startup_timeout:.0f} s; "
                                 f"{p.log_path}:\n{p.tail()}")
            time.sleep(0.2)

    def _watch(self) -> None:
        """Take a replica that exited out of the router's ring now, rather than at its next health check."""
        while not self._stopping.wait(0.2):
            for i, p in enumerate(self.replicas):
                if i not in self._removed and not p.alive():
                    self._removed.add(i)
                    log.error("%s exited with %s; its sessions continue on the others", p.name, p.proc.returncode)
                    self._remove_from_router(self.replica_urls[i])

    def _remove_from_router(self, url: str) -> None:
        query = urllib.parse.urlencode({"url": url})
        try:
            request = urllib.request.Request(f"{self.router_url}/remove_worker?{query}", method="POST")
            urllib.request.urlopen(request, timeout=5).close()
        except (urllib.error.URLError, OSError) as e:  # the health check takes it out instead
            log.warning("could not remove %s from the router: %s", url, e)

    def kill(self, i: int) -> None:
        """SIGKILL replica i (a crash, for failover tests and benchmarks)."""
        self.replicas[i].signal(signal.SIGKILL)
        self.replicas[i].proc.wait()

    def drain(self, i: int) -> None:
        """A planned drain of replica i: out of the router first (nothing new
        arrives), then SIGTERM: it finishes its requests in flight, each
        session saved as its turn ends, and exits. The ring's next replica
        takes its sessions up on their next turns."""
        self._removed.add(i)
        self._remove_from_router(self.replica_urls[i])
        self.replicas[i].stop(STOP_TIMEOUT_S)

    def interrupt(self) -> None:
        """Make wait() return (from a signal handler)."""
        self._stopping.set()

    def wait(self) -> int:
        """Until interrupt(), the router exits or the proxy stops: 0, or the router's exit code (1 for the proxy)."""
        while not self._stopping.wait(0.5):
            if self.router is not None and not self.router.alive():
                log.error("the router exited with %s; %s:\n%s", self.router.proc.returncode, self.router.log_path,
                          self.router.tail())
                return self.router.proc.returncode or 1
            if self.proxy is not None and not self.proxy.alive():
                log.error("the public proxy on %s:%d stopped (its error is logged above)", self.host, self.port)
                return 1
        return 0

    def stop(self) -> None:
        """The proxy and the router first (nothing new arrives), then every replica drains and exits;
        idempotent."""
        self._stopping.set()
        if self.proxy is not None:
            self.proxy.stop(PROXY_STOP_TIMEOUT_S)
        if self.router is not None:
            self.router.stop(10)
        for p in self.replicas:
            p.signal(signal.SIGTERM)
        for p in self.replicas:
            p.stop(STOP_TIMEOUT_S)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="serve.py cluster", description=__doc__.split("\n\n")[0],
                                     epilog="other flags go to every replica's serve.py (see `python serve.py --help`)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--state-dir", required=True,
                        help="shared by the replicas: sessions, stored responses and their KV (on a shared "
                             "filesystem across machines)")
    parser.add_argument("--host", default="127.0.0.1", help="the public one (the proxy's; the router's is 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000,
                        help="the public one; the replicas take the next ports, then the router's metrics, then "
                             "the router itself (on 127.0.0.1)")
    parser.add_argument("--policy", choices=POLICIES, default="consistent_hash",
                        help="the router's: consistent_hash (X-Session-Id affinity), cache_aware (prefix "
                             "trees), round_robin")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each replica")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    args, serve_args = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request the proxy forwards otherwise
    cluster = Cluster(args.replicas, args.state_dir, host=args.host, port=args.port, policy=args.policy,
                      threads=args.threads, serve_args=serve_args, startup_timeout=args.startup_timeout)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: cluster.interrupt())
    try:
        cluster.start()
    except ClusterError as e:
        parser.exit(1, f"serve.py cluster: {e}\n")
    code = cluster.wait()
    cluster.stop()
    sys.exit(code)
