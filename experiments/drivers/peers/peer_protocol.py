"""The JSON-lines protocol of the peer drivers (vllm_driver.py,
llamacpp_driver.py), shared by both: each runs in its peer's own venv as a
script and imports this file from beside it, nothing else of the repository.

The first line in is the driver's spec; the driver loads and warms up, and
answers {"ready": true, ...}. Then each line in is {"op": ...} and gets one
line back: the op's handler's answer, {"ok": true} for "quit" (which ends
the loop), or {"error": ...} for an unknown op."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

Reply = Callable[[dict], None]


def open_replies() -> Reply:
    """The replies go to a private copy of stdout; anything else written to
    fd 1 (a peer's logging, prints) goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    return reply


def read_spec() -> dict:
    return json.loads(sys.stdin.readline())


def serve(reply: Reply, handlers: dict[str, Callable[[dict], dict]]) -> None:
    """Answers each op on stdin with its handler's result until "quit"."""
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        if op == "quit":
            reply({"ok": True})
            break
        if op in handlers:
            reply(handlers[op](msg))
        else:
            reply({"error": f"unknown op {op!r}"})
