"""A folder of JSON records that survive a kill -9 or a crash: each is
replaced atomically (written to a temporary file, fsynced, renamed over the
old one, the folder fsynced), so a reader finds either the previous record
or the new one. Writers sharing the folder (replicas) never share a
temporary file. Records that cannot be read are reported, never
half-loaded. A record's stamp (its file's inode, size and modification
time) changes with every replacement, so a process sharing the folder (a
replica) can tell cheaply whether another has written a record since it
last read or wrote it."""
from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from agentkv.engine import fsync_dir, replace_durably

log = logging.getLogger("agentkv.state")

VERSION = 2  # 2: records name their tenant and namespace
T = TypeVar("T")
Stamp = tuple[int, int, int]


class JsonFiles:
    def __init__(self, root: str | Path, kind: str):
        self.kind = kind  # names the records in reports: "session", "response"
        self.root = Path(root) / f"{kind}s"
        self.root.mkdir(parents=True, exist_ok=True)
        self.reports: list[str] = []

    def write(self, name: str, body: dict) -> Stamp:
        path = self.root / f"{name}.json"
        # Writers of one record at once (replicas sharing the folder, on this machine or another, or
        # threads here) each write a temporary file of their own: a pid alone repeats across machines.
        tmp = path.with_suffix(f".json.{os.getpid()}-{uuid.uuid4().hex}.tmp")
        st = replace_durably(path, json.dumps({"version": VERSION, **body}).encode(), tmp)
        return st.st_ino, st.st_size, st.st_mtime_ns

    def stamp(self, name: str) -> Stamp | None:
        """The record's stamp now; None if there is none."""
        try:
            st = os.stat(self.root / f"{name}.json")
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def read(self, name: str, parse: Callable[[dict], T]) -> tuple[T, Stamp] | None:
        """parse(body) of one record and the stamp of what was read; None if
        there is none or it cannot be read (reported)."""
        path = self.root / f"{name}.json"
        try:
            with open(path) as f:
                st = os.fstat(f.fileno())
                return self._parse(path, json.load(f), parse), (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            return None
        except Exception as e:  # that record only
            self._report(path, e)
            return None

    def delete(self, name: str) -> None:
        (self.root / f"{name}.json").unlink(missing_ok=True)

    def rename(self, old: str, new: str) -> None:
        os.replace(self.root / f"{old}.json", self.root / f"{new}.json")
        fsync_dir(self.root)

    def count(self, prefix: str) -> int:
        """How many records have a name starting with prefix (one listing, nothing read)."""
        return sum(1 for _ in self.root.glob(f"{prefix}*.json"))

    def read_all(self, parse: Callable[[dict], T]) -> Iterator[T]:
        """parse(body) of every record; one that fails (torn, foreign, hand-edited) is reported and skipped."""
        for path in sorted(self.root.glob("*.json")):
            try:
                yield self._parse(path, json.loads(path.read_text()), parse)
            except Exception as e:  # that record only
                self._report(path, e)

    @staticmethod
    def _parse(path: Path, body: dict, parse: Callable[[dict], T]) -> T:
        if body.get("version") != VERSION:
            raise ValueError(f"version {body.get('version')!r}, not {VERSION}")
        return parse(body)

    def _report(self, path: Path, e: Exception) -> None:
        message = f"saved {self.kind} {path.name} cannot be resumed: {type(e).__name__}: {e}"
        log.warning(message)
        self.reports.append(message)
