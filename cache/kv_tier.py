"""The second tier of KV: host memory, then disk.

A sequence that leaves the page pool (idle past its pin under memory
pressure, or preempted) leaves its KV here instead of losing it; when it
comes back, the scheduler restores from here what the pool no longer holds
(a copy: bit-exact with the "pool" codec) and computes only the rest.

An entry is the KV of one token run, kept in page-sized pieces aligned to
the run's start: a later offload of the same conversation stores only the
pieces it lacks, a conversation that diverged keeps the pieces before the
divergence, and a piece on disk carries its own checksum. Entries are keyed
by a sequence family (a session and the forks that work its turns); what is
restored is only ever the common prefix of the entry's tokens and the
sequence's, within one namespace, so a stale entry costs a recompute, never
a wrong token.

Bounded: past host_bytes the least recently used entries move to disk
(spill_dir), past disk_bytes they are dropped (their conversations
recompute); an entry larger than the host tier is refused. Persistent
entries (sessions kept across restarts) are written through to disk
(cache.kv_disk, whose manifests name the model they belong to); load()
verifies them (identity and every piece's checksum) and reports what it
had to discard. Replicas sharing the disk (engine.api.cluster) adopt()
entries one by one instead, and dropping an entry removes only what this
tier wrote or read of it, never what another replica saved since.

On a GPU the copies to host go to pinned memory on a side stream, so an
offload overlaps the next step; every reader waits for its copy first.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agentkv.kernels import dispatch
from agentkv.cache import kv_codec
from agentkv.cache.block_table import BlockTable
from agentkv.cache.errors import PageAccountingError
from agentkv.cache.kv_disk import CorruptKV, DiskWriteError, KVDisk
from agentkv.cache.pool import PagePool
from agentkv.cache.tokens import common_prefix_len

log = logging.getLogger("agentkv.kv_tier")


@dataclass
class TierCounters:
    offloads: int = 0
    offload_bytes: int = 0
    offload_s: float = 0.0
    restores: int = 0
    restored_tokens: int = 0
    restore_bytes: int = 0
    restore_s: float = 0.0
    spilled_bytes: int = 0  # written to disk
    disk_read_bytes: int = 0
    dropped: int = 0  # entries given up for room
    refused: int = 0  # offloads that did not fit
    corrupt: int = 0  # entries whose files failed verification
    disk_errors: int = 0  # writes to the disk tier that failed (the entry kept what was on disk before)


@dataclass(eq=False)
class _Piece:
    n: int  # tokens: page_size, but for the last piece of an entry
    nbytes: int
    parts: dict[str, torch.Tensor] | None  # in host memory
    ready: "torch.cuda.Event | None" = None  # the async copy to host, until done
    file: str | None = None  # on disk: the file (in the entry's folder) holding it
    name: str = ""  # its tensors' prefix in that file
    crc: int | None = None


@dataclass(eq=False)
class _Entry:
    key: str
    namespace: str
    tokens: list[int]
    pieces: list[_Piece] = field(default_factory=list)
    used: int = 0
    persistent: bool = False
    manifest: str | None = None  # the id of its manifest on disk, as written or read here


class KVTier:
    def __init__(
        self,
        pool: PagePool,
        host_bytes: int,
        spill_dir: str | Path | None = None,
        disk_bytes: int = 16 << 30,
        codec: str = "pool",
        identity: dict | None = None,
    ):
        if host_bytes < 0 or disk_bytes < 0:
            raise ValueError("tier sizes must be >= 0")
        kv_codec.encode(torch.zeros(1), codec)  # rejects an unknown codec now
        self.pool, self.host_bytes, self.disk_bytes, self.codec = pool, host_bytes, disk_bytes, codec
        one = pool.read_slots(torch.zeros(1, dtype=torch.long, device=pool.kv.device))
        self.token_bytes = kv_codec.nbytes(kv_codec.encode(one, codec))  # as stored here
        self.identity = {**(identity or {}), "codec": codec, "page_size": pool.page_size,
                         "kv_dtype": str(pool.kv.dtype), "kv_shape": list(one.shape[1:])}
        self.disk = KVDisk(spill_dir, self.identity) if spill_dir is not None else None
        self.counters = TierCounters()
        self.reports: list[str] = []  # what load() or a restore found wrong, for operators
        self.host_used = 0
        self.disk_used = 0
        self._entries: dict[str, _Entry] = {}
        self._clock = 0
        self._lock = threading.RLock()
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="agentkv-prefetch")
        cuda = pool.kv.device.type == "cuda"
        self._side = torch.cuda.Stream(pool.kv.device) if cuda else None

    # -- what the tier holds --------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def tokens_held(self, key: str) -> int:
        e = self._entries.get(key)
        return len(e.tokens) if e is not None else 0

    def match(self, key: str, namespace: str, tokens: list[int], limit: int) -> int:
        """How many leading tokens of `tokens` (at most limit) the tier can restore."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.namespace != namespace or limit < 1:
                return 0
            return min(common_prefix_len(e.tokens, tokens), limit)

    # -- offload ---------------------------------------------------------

    def offload(self, key: str, namespace: str, tokens: list[int], table: BlockTable, replace: bool = True) -> bool:
        """Store the KV of the table's tokens (tokens[:table.length]) under key,
        copying only the pieces the entry lacks. An entry that already holds
        all of it stays as it is (a session's entry after the fork working
        its turn stored more); one that diverges is replaced only with
        replace. False if nothing was stored (no room, or not replaced)."""
        n = table.length
        if n < 1:
            return False
        start_t = time.perf_counter()
        ps = self.pool.page_size
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.namespace != namespace:
                self._drop(e, for_room=False)
                e = None
            keep = 0
            if e is not None:
                same = common_prefix_len(e.tokens, tokens[:n])
                if same == n:
                    self._touch(e)
                    return True
                if not replace:
                    return False
                keep = min(same // ps, sum(1 for p in e.pieces if p.n == ps))
                for p in e.pieces[keep:]:
                    self._forget_piece(p)
                del e.pieces[keep:]
            start = keep * ps
            new_bytes = (n - start) * self.token_bytes
            kept_bytes = sum(p.nbytes for p in e.pieces if p.parts is not None) if e is not None else 0
            if kept_bytes + new_bytes > self.host_bytes or not self._fit(new_bytes, protect=key):
                if e is not None and e.persistent:  # what it still holds stays saved
                    e.tokens = e.tokens[:start]
                    self._write(e)
                elif e is not None:
                    self._drop(e)
                self.counters.refused += 1
                return False
            if e is None:
                e = self._entries[key] = _Entry(key, namespace, [])
            e.tokens = list(tokens[:n])
            if start < n:
                kv = self.pool.read_slots(table.slots(start, n))
                parts, ready = self._to_host(kv_codec.encode(kv, self.codec))
                for a in range(0, n - start, ps):
                    piece_parts = {k: v[a : a + ps] for k, v in parts.items()}
                    nb = kv_codec.nbytes(piece_parts)
                    e.pieces.append(_Piece(min(ps, n - start - a), nb, piece_parts, ready))
                    self.host_used += nb
                self.counters.offload_bytes += new_bytes
            self._touch(e)
            self.counters.offloads += 1
            if e.persistent:
                self._write(e)
        self.counters.offload_s += time.perf_counter() - start_t
        return True

    def _to_host(self, parts: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], "torch.cuda.Event | None"]:
        if self._side is None:
            return parts, None
        main = torch.cuda.current_stream(self.pool.kv.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            host = {}
            for k, v in parts.items():
                host[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                host[k].copy_(v, non_blocking=True)
                v.record_stream(self._side)  # the device copy lives until the side stream is done with it
            ready = torch.cuda.Event()
            ready.record(self._side)
        return host, ready

    # -- restore ---------------------------------------------------------

    def restore(self, key: str, table: BlockTable, end: int) -> int:
        """Copy the entry's KV of positions [table.length, end) into the table
        (pages are reserved here: the caller has made room). Returns the
        tokens restored; 0 if the entry's files fail verification (the entry
        is dropped and reported)."""
        start_t = time.perf_counter()
        start, ps = table.length, self.pool.page_size
        with self._lock:
            e = self._entries.get(key)
            if e is None or end <= start or end > len(e.tokens):
                return 0
            first, last = start // ps, -(-end // ps)
            try:
                parts = [self._load(e, p) for p in e.pieces[first:last]]
            except CorruptKV as err:
                self._report(f"session KV {key}: {err}; it recomputes")
                self._drop(e, for_room=False)
                return 0
            kv = torch.cat([kv_codec.decode(p, self.pool.kv.dtype) for p in parts])[start - first * ps : end - first * ps]
            self._touch(e)
            copies = table.reserve(end - start)
            if copies:
                src, dst = zip(*copies)
                device = self.pool.kv.device
                dispatch.copy_pages(self.pool.kv, torch.tensor(src, device=device), torch.tensor(dst, device=device))
            self.pool.write_slots(table.slots(start, end), kv)
            table.advance(end - start)
            c = self.counters
            c.restores += 1
            c.restored_tokens += end - start
            c.restore_bytes += (end - start) * self.token_bytes
        c.restore_s += time.perf_counter() - start_t
        return end - start

    def _load(self, e: _Entry, p: _Piece) -> dict[str, torch.Tensor]:
        if p.parts is not None:
            if p.ready is not None:
                p.ready.synchronize()
                p.ready = None
            return p.parts
        parts = self._read(e, p)
        if self._fit(p.nbytes, protect=e.key):
            p.parts = parts
            self.host_used += p.nbytes
        return parts

    def _read(self, e: _Entry, p: _Piece) -> dict[str, torch.Tensor]:
        parts = self.disk.read_piece(e.key, p.file, p.name, p.crc)
        self.counters.disk_read_bytes += p.nbytes
        return parts

    def prefetch(self, key: str) -> None:
        """Bring the entry's pieces on disk back to host memory, in the background."""
        e = self._entries.get(key)
        if e is not None and any(p.parts is None for p in e.pieces):
            self._prefetcher.submit(self._prefetch, key)

    def _prefetch(self, key: str) -> None:
        # Files are read outside the lock: steps restoring other sessions go on meanwhile.
        with self._lock:
            e = self._entries.get(key)
            todo = [p for p in e.pieces if p.parts is None] if e is not None else []
        for p in todo:
            try:
                parts = self._read(e, p)
            except CorruptKV as err:
                with self._lock:
                    if self._entries.get(key) is e and p in e.pieces:  # not a file a rewrite removed meanwhile
                        self._report(f"session KV {key}: {err}; it recomputes")
                        self._drop(e, for_room=False)
                return
            with self._lock:
                if self._entries.get(key) is not e or p not in e.pieces or p.parts is not None:
                    return  # changed meanwhile: a restore reads what it needs itself
                if not self._fit(p.nbytes, protect=key):
                    return
                p.parts = parts
                self.host_used += p.nbytes

    # -- room ------------------------------------------------------------

    def _fit(self, nbytes: int, protect: str) -> bool:
        """Make nbytes of host room: least recently used entries go to disk
        (or, without one, away). Whether there is room."""
        while self.host_used + nbytes > self.host_bytes:
            victims = [e for e in self._entries.values()
                       if e.key != protect and any(p.parts is not None for p in e.pieces)]
            if not victims:
                return False
            e = min(victims, key=lambda x: x.used)
            # An entry whose pieces are all on disk has its manifest there already: rewriting it
            # could undo what a replica sharing the disk wrote since (cache.kv_disk).
            if self.disk is not None and (all(p.file is not None for p in e.pieces) or self._write(e)):
                for p in e.pieces:
                    self._evict_from_host(p)
            elif e.persistent:
                self._keep_what_is_on_disk(e)  # its saved state is never given up for room
            else:
                self._drop(e)
        return True

    def _keep_what_is_on_disk(self, e: _Entry) -> None:
        """Cut the entry to its leading pieces on disk (what its manifest
        there names), none of them in host memory."""
        keep = next((i for i, p in enumerate(e.pieces) if p.file is None), len(e.pieces))
        for p in e.pieces[keep:]:
            self._forget_piece(p)
        del e.pieces[keep:]
        e.tokens = e.tokens[:sum(p.n for p in e.pieces)]
        for p in e.pieces:
            self._evict_from_host(p)

    def _evict_from_host(self, p: _Piece) -> None:
        if p.parts is not None and p.file is not None:
            p.parts = None
            p.ready = None
            self.host_used -= p.nbytes

    def _forget_piece(self, p: _Piece) -> None:
        if p.parts is not None:
            self.host_used -= p.nbytes
        if p.file is not None:
            self.disk_used -= p.nbytes
        p.parts = None
        p.file = None

    def _drop(self, e: _Entry, for_room: bool = True) -> None:
        files = {p.file for p in e.pieces if p.file is not None}
        for p in e.pieces:
            self._forget_piece(p)
        self._entries.pop(e.key, None)
        self.counters.dropped += for_room
        if self.disk is not None:
            self.disk.discard(e.key, files, e.manifest)

    def drop(self, key: str, persistent: bool = False) -> None:
        """Forget the entry (a persistent one only with persistent=True)."""
        with self._lock:
            e = self._entries.get(key)
            if e is not None and (persistent or not e.persistent):
                self._drop(e, for_room=False)

    def _touch(self, e: _Entry) -> None:
        self._clock += 1
        e.used = self._clock

    def _report(self, message: str, corrupt: bool = True) -> None:
        log.warning(message)
        self.reports.append(message)
        self.counters.corrupt += corrupt

    # -- disk ------------------------------------------------------------

    def _write(self, e: _Entry) -> bool:
        """Write the entry's pieces not on disk yet (one new file) and its
        manifest. False if the disk tier has no room for them."""
        if self.disk is None:
            return False
        todo = [p for p in e.pieces if p.file is None]
        need = sum(p.nbytes for p in todo)
        while self.disk_used + need > self.disk_bytes:
            victims = [x for x in self._entries.values() if x is not e and not x.persistent
                       and any(p.file is not None for p in x.pieces)]
            if not victims:
                return False
            self._drop(min(victims, key=lambda x: x.used))
        try:
            if todo:
                filename, written = self.disk.write_pieces(e.key, [self._load(e, p) for p in todo])
                for p, (name, crc) in zip(todo, written):
                    p.file, p.name, p.crc = filename, name, crc
                self.disk_used += need
                self.counters.spilled_bytes += need
            e.manifest = self.disk.write_manifest(e.key, {
                "namespace": e.namespace, "persistent": e.persistent, "tokens": e.tokens,
                "pieces": [{"n": p.n, "nbytes": p.nbytes, "file": p.file, "name": p.name, "crc": p.crc}
                           for p in e.pieces],
            })
        except DiskWriteError as err:
            # A failing disk fails no request: the entry stays as it was in host
            # memory (or gives way, and its session recomputes), and it is said.
            self.counters.disk_errors += 1
            self._report(f"session KV {e.key}: {err}", corrupt=False)
            return False
        return True

    def persist(self, key: str) -> bool:
        """Keep the entry across restarts: written through to disk from now on."""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return False
            if e.persistent:
                return True  # its offloads already write through
            e.persistent = True
            errors = self.counters.disk_errors
            if not self._write(e):
                e.persistent = False
                if self.counters.disk_errors == errors:  # else the error was reported
                    self._report(f"session KV {key}: the disk tier is full; it is not persisted", corrupt=False)
                return False
            return True

    def load(self) -> list[str]:
        """Register the persistent entries found on disk, verified: the model
        identity and every piece's checksum. What fails is reported and
        removed (its session recomputes). Returns the keys loaded. Only for
        a disk that is this tier's alone: replicas sharing one adopt instead."""
        if self.disk is None:
            return []
        loaded = []
        with self._lock:
            for key, m, problem in self.disk.saved():
                try:
                    if problem is not None:
                        raise CorruptKV(problem)
                    e = _from_manifest(key, m)
                    for p in e.pieces:
                        self._read(e, p)
                except (CorruptKV, ValueError, KeyError, TypeError) as err:
                    self._report(f"session KV {key}: {err}; it recomputes")
                    self.disk.remove(key)
                    continue
                self._register(e)
                loaded.append(key)
        return loaded

    def adopt(self, key: str) -> bool:
        """Take up the persistent entry under key as it is on disk now, in
        place of what this tier held of it: another process sharing the disk
        (a replica, engine.api.cluster) may have written it since. Its pieces
        are verified when a restore reads them. False if there is none usable
        (its session recomputes); nothing on disk is removed."""
        if self.disk is None:
            return False
        m, problem = self.disk.manifest(key)
        with self._lock:
            old = self._entries.pop(key, None)
            for p in old.pieces if old is not None else []:
                self._forget_piece(p)
            try:
                if problem is not None:
                    raise CorruptKV(problem)
                if m is None:
                    return False
                self._register(_from_manifest(key, m))
            except (CorruptKV, ValueError, KeyError, TypeError) as err:
                self._report(f"session KV {key}: {err}; it recomputes")
                return False
            return True

    def _register(self, e: _Entry) -> None:
        self._entries[e.key] = e
        self.disk_used += sum(p.nbytes for p in e.pieces)
        self._touch(e)

    def persistent_keys(self) -> list[str]:
        with self._lock:
            return [k for k, e in self._entries.items() if e.persistent]

    def check(self) -> None:
        """Raise PageAccountingError unless the byte counts match the pieces."""
        with self._lock:
            host = sum(p.nbytes for e in self._entries.values() for p in e.pieces if p.parts is not None)
            disk = sum(p.nbytes for e in self._entries.values() for p in e.pieces if p.file is not None)
            if (host, disk) != (self.host_used, self.disk_used):
                raise PageAccountingError(f"tier counts host {self.host_used} disk {self.disk_used}, pieces hold "
                                          f"{host} and {disk}")
            if self.host_used > self.host_bytes or self.disk_used > self.disk_bytes:
                raise PageAccountingError("the tier is past its size cap")


def _from_manifest(key: str, m: dict) -> _Entry:
    """A persistent entry as its manifest names it, its pieces on disk only."""
    e = _Entry(key, m["namespace"], list(m["tokens"]), persistent=True, manifest=m.get("id"))
    e.pieces = [_Piece(int(p["n"]), int(p["nbytes"]), None, None, p["file"], p["name"], p["crc"]) for p in m["pieces"]]
    if sum(p.n for p in e.pieces) != len(e.tokens) or any(p.file is None for p in e.pieces):
        raise CorruptKV("its manifest does not match its pieces")
    return e
