"""A folder of JSON records that survive a kill -9: each is replaced
atomically (written to a temporary file, fsynced, renamed over the old
one), so a reader finds either the previous record or the new one. Records
that cannot be read are reported, never half-loaded."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Iterator, TypeVar

log = logging.getLogger("agentkv.state")

VERSION = 2  # 2: records name their tenant and namespace
T = TypeVar("T")


class JsonFiles:
    def __init__(self, root: str | Path, kind: str):
        self.kind = kind  # names the records in reports: "session", "response"
        self.root = Path(root) / f"{kind}s"
        self.root.mkdir(parents=True, exist_ok=True)
        self.reports: list[str] = []

    def write(self, name: str, body: dict) -> None:
        path = self.root / f"{name}.json"
        tmp = path.with_suffix(".json.tmp")
        with open(tmp, "w") as f:
            json.dump({"version": VERSION, **body}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def delete(self, name: str) -> None:
        (self.root / f"{name}.json").unlink(missing_ok=True)

    def read_all(self, parse: Callable[[dict], T]) -> Iterator[T]:
        """parse(body) of every record; one that fails (torn, foreign, hand-edited) is reported and skipped."""
        for path in sorted(self.root.glob("*.json")):
            try:
                body = json.loads(path.read_text())
                if body.get("version") != VERSION:
                    raise ValueError(f"version {body.get('version')!r}, not {VERSION}")
                yield parse(body)
            except Exception as e:  # that record only
                message = f"saved {self.kind} {path.name} cannot be resumed: {type(e).__name__}: {e}"
                log.warning(message)
                self.reports.append(message)
