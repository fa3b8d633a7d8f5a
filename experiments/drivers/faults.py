"""Faults the soak (experiments/soak.py) injects into a running server: a
corrupted piece of saved KV, a SIGKILL of the whole server, and a disk that
fills (a small tmpfs). Streams its agents drop are their client's
(experiments/drivers/soak_client.py)."""
from __future__ import annotations

import os
import random
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from agentkv.experiments.drivers.servers import ServerProcess


def corrupt_piece(folder: Path, seed: int) -> Path | None:
    """Overwrite 64 bytes in the middle of the largest saved KV piece under
    folder (what a bad sector or a torn write leaves); None if none is saved."""
    pieces = sorted(folder.rglob("*.safetensors"), key=lambda p: (p.stat().st_size, p.name))
    if not pieces:
        return None
    piece = pieces[-1]
    size = piece.stat().st_size
    with open(piece, "r+b") as f:
        f.seek(size // 2)
        f.write(random.Random(seed).randbytes(64))
    return piece


def kill(server: ServerProcess) -> None:
    """SIGKILL the server's whole process group: nothing is flushed or saved."""
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.proc.wait()
    server.stop()  # closes its log; the process is gone already


class DiskFaultUnavailable(RuntimeError):
    """A small disk cannot be mounted here (mounting a tmpfs needs root)."""


@contextmanager
def small_disk(folder: Path, size_bytes: int) -> Iterator[Path]:
    """folder as a tmpfs of size_bytes (at least 1 MiB), so that writes past
    it fail with ENOSPC as on a full disk; unmounted (and what it held gone)
    on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    size = max(size_bytes, 1 << 20)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise DiskFaultUnavailable(f"mount -t tmpfs on {folder}: {r.stderr.strip() or r.returncode} "
                                   f"(the soak's full-disk fault needs root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)
