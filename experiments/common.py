"""Shared plumbing of the experiment scripts: model shapes, the systems
flag, run folders, the machine's description. Output is experiments.report's."""
from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from agentkv.model import shapes
from agentkv.model.config import ModelConfig
from agentkv.model.llama import Transformer

# Named model shapes for random-weight benchmarks (Hugging Face config
# fields): the published ones of model/shapes.py, and the project's own tiny one.
SHAPES = {
    **shapes.SHAPES,
    "tiny": dict(
        model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384, tie_word_embeddings=True,
    ),
}


def random_model(shape: str, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> Transformer:
    return shapes.random_model(ModelConfig.from_hf(SHAPES[shape]), dtype, seed, device)


def parse_systems(text: str, known: tuple[str, ...]) -> list[str]:
    """A benchmark's comma-separated --systems, each one it knows."""
    systems = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in systems if s not in known]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(known)}")
    return systems


def run_dir(name: str, out: str | Path | None = None) -> Path:
    """The run's folder, created: out when given (a benchmark's --out), else runs/NAME-<time>."""
    path = Path(out) if out else Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")


def machine() -> dict:
    """The host as a report states it: CPU model and vector ISA (as lscpu shows them), cores, versions, commit."""
    info = {"model name": platform.processor() or platform.machine(), "cpu family": "", "model": "", "flags": ""}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in info and value.strip():
                info[key.strip()] = value.strip()
    flags = set(info["flags"].split())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent.parent,
                            capture_output=True, text=True).stdout.strip()
    return {
        "argv": sys.argv,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": f"{info['model name']} (family {info['cpu family']} model {info['model']})",
        "isa": [f for f in ISA_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "commit": commit or None,
    }


@contextlib.contextmanager
def environ(name: str, value: str) -> Iterator[None]:
    """The environment variable set to value for the block, then as it was
    (AGENTKV_KERNELS: read at each dispatch; AGENTKV_CPU_ISA: once a forward,
    or by kernels.cpu_extension.isa())."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _cpu_times() -> tuple[int, int] | None:
    """The machine's (busy, total) CPU time in ticks since boot, from
    /proc/stat's first line; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def wait_for_quiet(max_s: float = 5.0, window_s: float = 0.2, below: float = 0.25) -> float:
    """Wait until the whole machine keeps fewer than `below` cores busy over
    a window_s window, for at most max_s; the seconds waited. A benchmark
    that serves each turn on every system in turn calls it before each turn:
    vLLM's engine core spins on after a request, so without it the next
    system's turn began on a machine still busy with the last one's. 0 at
    once where /proc/stat is missing or max_s <= 0."""
    start = time.perf_counter()
    cores = os.cpu_count() or 1
    while time.perf_counter() - start < max_s:
        a = _cpu_times()
        if a is None:
            break
        time.sleep(window_s)
        b = _cpu_times()
        if b is None or b[1] == a[1] or (b[0] - a[0]) / (b[1] - a[1]) * cores < below:
            break
    return time.perf_counter() - start
