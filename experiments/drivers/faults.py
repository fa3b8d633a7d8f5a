"""Faults the soak (experiments/soak.py) injects into a running server:
streams dropped by their client, a corrupted piece of saved KV, and a
SIGKILL of the whole server."""
from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import httpx

from agentkv.experiments.drivers.servers import ServerProcess


def drop_stream(url: str, key: str, body: dict, after_first_token: bool) -> bool:
    """Send a streamed chat request and hang up: at once (a read timeout of
    a few milliseconds, before the server can answer), or right after its
    first content chunk. Whether anything had come back when the client
    went away; RuntimeError if the server refused the request."""
    headers = {"Authorization": f"Bearer {key}"}
    timeout = httpx.Timeout(600.0, read=600.0 if after_first_token else 0.005)
    with httpx.Client(base_url=url, headers=headers, timeout=timeout) as http:
        try:
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                if r.status_code != 200:  # refused: nothing was dropped, and the soak must not read it as a drop
                    raise RuntimeError(f"the stream to drop was refused: {r.status_code} {r.read().decode()[:200]}")
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        return True
        except httpx.ReadTimeout:
            return False
    return False


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
