"""OpenAI-compatible servers the benchmarks talk to over HTTP: this
engine's serve.py (or vLLM's server, experiments.drivers.vllm) in a
subprocess, or this engine's app in a thread of this process. Each has
url (http://127.0.0.1:PORT), base_url (url + "/v1", the openai client's),
metrics(), counters() and stop().

    with start_engine_server(extra_args=["--kv-cache-gb", "2"]) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
        ...
        server.counters()["vllm:prefix_cache_hits_total"]
"""
from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from agentkv.experiments.drivers.system import ROOT

# vLLM's names; this engine's /metrics exports them too.
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$")


def scrape_metrics(url: str) -> dict[str, float]:
    """GET url/metrics, parsed."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: each series' value by name, summed over its label
    sets (vLLM labels its counters per engine and model); histogram buckets
    left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not m.group(1).endswith("_bucket"):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


class _Server:
    url: str

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.url)

    def counters(self) -> dict[str, float]:
        """The prefix-cache hit and query token counters and the preemption
        count (0 for one the server does not export)."""
        m = self.metrics()
        return {name: m.get(name, 0.0) for name in COUNTERS}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess(_Server):
    """A server command in a subprocess (its own process group, so that stop()
    also ends the children it spawns), ready once GET /health answers 200.
    Its stdout and stderr go to log."""

    def __init__(self, cmd: Sequence[str], port: int, *, env: dict[str, str] | None = None,
                 log: Path | None = None, startup_timeout: float = 600.0, name: str = "server", cwd: Path = ROOT):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        if log is None:
            fd, tmp = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
            os.close(fd)
            log = Path(tmp)
        self.log = log
        self._logf = open(log, "a")
        self._logf.write(f"\n=== {name}: {' '.join(cmd)}\n")
        self._logf.flush()
        self.proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=self._logf,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        atexit.register(self.stop)  # no server outlives a benchmark that raised
        start = time.perf_counter()
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - start

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} exited with {code} before it was ready; {self.log}:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s; see {self.log}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 30 s; idempotent."""
        atexit.unregister(self.stop)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self._logf.close()


def start_engine_server(model: str | Path | None = None, *, port: int | None = None, threads: int | None = None,
                        extra_args: Sequence[str] = (), log: Path | None = None,
                        startup_timeout: float = 300.0, env: dict[str, str] | None = None) -> ServerProcess:
    """This engine's server (python serve.py --port P [--model DIR] ...extra_args:
    serve.py's flags, e.g. --kv-cache-gb, --max-num-seqs) on 127.0.0.1.
    threads: OMP_NUM_THREADS, torch's intra-op threads (default: all cores);
    env: more of its environment (e.g. AGENTKV_KERNELS=torch)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "agentkv.serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--model", str(model)] if model else []
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}), **(env or {})}
    return ServerProcess(cmd + list(extra_args), port, env=env, log=log, startup_timeout=startup_timeout,
                         name="agentkv-server")


class AppThread(_Server):
    """An ASGI app on 127.0.0.1 in a thread of this process."""

    def __init__(self, app):
        import uvicorn

        sock = socket.socket()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._uv.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        while not self._uv.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self._uv.should_exit = True
        self._thread.join(30)


class InProcessServer(AppThread):
    """This engine's app on 127.0.0.1 in a thread of this process, so that
    the caller keeps the engine (its scheduler counters, its pool)."""

    def __init__(self, engine, model_name: str):
        from agentkv.engine.api import create_app

        self.engine = engine
        super().__init__(create_app(engine, model_name))
