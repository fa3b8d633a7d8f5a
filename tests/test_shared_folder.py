"""One state folder shared by replicas (serve.py --state-dir --shared-state):
two writers on one folder, as two replica processes are, never lose or
corrupt each other's entries. Their temporary files and KV pieces have
names of their own, a writer's cleanup keeps what the other wrote, a
corrupt piece fails only the entry that names it, and every rename is
followed by an fsync of its directory."""
from __future__ import annotations

import json
import multiprocessing
import os
import stat
import threading
from pathlib import Path

import pytest
import torch

from agentkv.cache.block_table import BlockTable
from agentkv.cache.kv_disk import KVDisk
from agentkv.cache.kv_tier import KVTier
from agentkv.cache.pool import PagePool
from agentkv.engine.api.json_files import JsonFiles
from agentkv.engine.api.session_files import SavedSession, SessionFiles

PS = 4
KEY = "0123456789abcdef"
NS = "tenant"


class Replica:
    """One replica's second tier over the shared folder, with a pool of its own."""

    def __init__(self, folder: Path):
        self.pool = PagePool(2, 2, 4, 64, PS)
        # Room in host memory for 16 tokens: offloading another 12-token entry
        # pushes the rest out, so that a restore reads the disk.
        self.tier = KVTier(self.pool, 16 * self.pool.token_bytes, folder)

    def offload(self, key: str, tokens: list[int], kv: torch.Tensor) -> None:
        table = BlockTable(self.pool)
        table.reserve(len(tokens))
        table.advance(len(tokens))
        self.pool.write_slots(table.slots(0, len(tokens)), kv[: len(tokens)])
        assert self.tier.offload(key, NS, tokens, table)
        table.release()

    def restored(self, key: str, n: int) -> torch.Tensor | None:
        """The KV a restore of the entry's first n tokens brings back, read from disk."""
        self.offload(os.urandom(8).hex(), list(range(12)), kv_of(12, seed=99))  # the entry leaves host memory
        table = BlockTable(self.pool)
        got = self.tier.restore(key, table, n)
        kv = self.pool.read_slots(table.slots(0, got)) if got == n else None
        table.release()
        return kv


def kv_of(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 2, 2, 2, 4, generator=torch.Generator().manual_seed(seed))


def diverged(base: torch.Tensor, seed: int) -> torch.Tensor:
    """base's first 8 tokens' KV, then 4 of another continuation."""
    return torch.cat([base[:8], kv_of(4, seed)])


def shared_entry(tmp_path: Path) -> tuple[Replica, Replica, torch.Tensor]:
    """Replica a saved the entry's first 8 tokens; b took it up as on failover."""
    a, b = Replica(tmp_path), Replica(tmp_path)
    base = kv_of(8, seed=1)
    a.offload(KEY, list(range(8)), base)
    assert a.tier.persist(KEY)
    assert b.tier.adopt(KEY)
    return a, b, base


def adopted(folder: Path) -> Replica:
    """A third replica, taking the entry up as it is on disk now."""
    r = Replica(folder)
    assert r.tier.adopt(KEY)
    return r


def test_two_writers_extending_one_entry_never_overwrite_each_others_pieces(tmp_path):
    a, b, base = shared_entry(tmp_path)
    kv_a, kv_b = diverged(base, 2), diverged(base, 3)
    a.offload(KEY, list(range(12)), kv_a)
    b.offload(KEY, [*range(8), 100, 101, 102, 103], kv_b)
    assert torch.equal(a.restored(KEY, 12), kv_a)
    assert torch.equal(b.restored(KEY, 12), kv_b)
    assert a.tier.counters.corrupt == b.tier.counters.corrupt == 0


def test_a_writers_cleanup_keeps_the_piece_another_is_about_to_name(tmp_path, monkeypatch):
    a, b, base = shared_entry(tmp_path)
    kv_a, kv_b = diverged(base, 2), diverged(base, 3)
    write_manifest = b.tier.disk.write_manifest

    def a_writes_first(key: str, manifest: dict) -> str:
        # b's new piece is on disk, its manifest not yet: a rewrites the entry meanwhile.
        a.offload(KEY, list(range(12)), kv_a)
        return write_manifest(key, manifest)

    monkeypatch.setattr(b.tier.disk, "write_manifest", a_writes_first)
    b.offload(KEY, [*range(8), 100, 101, 102, 103], kv_b)
    assert torch.equal(b.restored(KEY, 12), kv_b)
    assert torch.equal(a.restored(KEY, 12), kv_a)
    assert torch.equal(adopted(tmp_path).restored(KEY, 12), kv_b)


def test_dropping_an_entry_keeps_what_another_writer_saved_of_it_since(tmp_path):
    a, b, base = shared_entry(tmp_path)
    kv_b = diverged(base, 3)
    b.offload(KEY, [*range(8), 100, 101, 102, 103], kv_b)  # b's manifest names a's first piece and its own
    a.tier.drop(KEY, persistent=True)  # e.g. a stored response expired on a
    assert torch.equal(b.restored(KEY, 12), kv_b)
    assert torch.equal(adopted(tmp_path).restored(KEY, 12), kv_b)


def test_a_corrupt_piece_fails_only_the_entry_that_names_it(tmp_path):
    a, b, base = shared_entry(tmp_path)
    other = kv_of(8, seed=5)
    a.offload("fedcba9876543210", list(range(8)), other)
    assert a.tier.persist("fedcba9876543210")
    kv_a, kv_b = diverged(base, 2), diverged(base, 3)
    a.offload(KEY, list(range(12)), kv_a)
    a_piece = json.loads((tmp_path / KEY / "manifest.json").read_text())["pieces"][-1]["file"]
    b.offload(KEY, [*range(8), 100, 101, 102, 103], kv_b)  # b's manifest is the entry's now
    path = tmp_path / KEY / a_piece
    raw = bytearray(path.read_bytes())
    raw[-9] ^= 0x5A
    path.write_bytes(bytes(raw))
    assert a.restored(KEY, 12) is None  # a's own version fails, counted and said
    assert a.tier.counters.corrupt == 1 and any("checksum" in r for r in a.tier.reports)
    assert torch.equal(a.restored("fedcba9876543210", 8), other)
    assert torch.equal(b.restored(KEY, 12), kv_b)
    assert torch.equal(adopted(tmp_path).restored(KEY, 12), kv_b)


def _write_manifests(root: str, start: "multiprocessing.synchronize.Barrier", n: int) -> None:
    disk = KVDisk(root, {"model": "m"})
    start.wait()
    for _ in range(n):
        # Long enough that a write takes a while: another writer's has time to land meanwhile.
        disk.write_manifest(KEY, {"namespace": NS, "persistent": True, "tokens": [os.getpid()] * 20000,
                                  "pieces": []})


@pytest.mark.slow
def test_two_processes_replacing_one_manifest_never_collide(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(3)
    writers = [ctx.Process(target=_write_manifests, args=(str(tmp_path), start, 150)) for _ in range(2)]
    for w in writers:
        w.start()
    start.wait()
    torn = 0
    while any(w.is_alive() for w in writers):
        try:
            m = json.loads((tmp_path / KEY / "manifest.json").read_text())
            torn += len(set(m["tokens"])) != 1 or len(m["tokens"]) != 20000
        except FileNotFoundError:
            pass
        except ValueError:
            torn += 1
    for w in writers:
        w.join()
    assert [w.exitcode for w in writers] == [0, 0]
    assert torn == 0


@pytest.mark.slow
def test_two_stores_replacing_one_record_at_once_never_collide(tmp_path):
    # Two writers of one pid: two stores in one process, or replicas on two machines sharing the folder.
    errors: list[BaseException] = []

    def write(store: JsonFiles, tag: int) -> None:
        try:
            for i in range(200):
                store.write("record", {"tag": tag, "i": i, "pad": [tag] * 2000})
        except BaseException as e:  # the test's verdict, not a crash of the thread
            errors.append(e)

    threads = [threading.Thread(target=write, args=(JsonFiles(tmp_path, "session"), t)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert JsonFiles(tmp_path, "session").read("record", lambda b: b["tag"]) is not None
    assert list((tmp_path / "sessions").iterdir()) == [tmp_path / "sessions" / "record.json"]


def test_a_record_whose_tier_key_is_not_a_folder_name_is_reported_not_resumed(tmp_path):
    # Its key names the session's folder in the disk tier: "" would be the tier's root, which dropping
    # the session's KV would remove.
    files = SessionFiles(tmp_path)
    for key in ("", "..", "../sessions", KEY):
        files.save(SavedSession("open", f"s{len(key)}", NS, key, [1, 2], []))
    assert [s.key for s in files.load(vocab_size=8)] == [KEY]
    assert sum("bad tier key" in r for r in files.reports) == 3


def recording_renames_and_fsyncs(monkeypatch) -> list[tuple]:
    """("replace", folder of the new name) and ("fsync dir", its inode), in order."""
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            events.append(("fsync dir", st.st_ino))
        real_fsync(fd)

    def replace(src, dst) -> None:
        real_replace(src, dst)
        events.append(("replace", Path(dst).parent.stat().st_ino))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def fsynced_after_each_rename(events: list[tuple]) -> bool:
    renames = [i for i, e in enumerate(events) if e[0] == "replace"]
    return bool(renames) and all(("fsync dir", events[i][1]) in events[i + 1:] for i in renames)


def test_a_manifest_rename_is_followed_by_an_fsync_of_its_folder(tmp_path, monkeypatch):
    events = recording_renames_and_fsyncs(monkeypatch)
    KVDisk(tmp_path, {}).write_manifest(KEY, {"namespace": NS, "persistent": True, "tokens": [], "pieces": []})
    assert fsynced_after_each_rename(events), events


def test_a_record_rename_is_followed_by_an_fsync_of_its_folder(tmp_path, monkeypatch):
    events = recording_renames_and_fsyncs(monkeypatch)
    files = JsonFiles(tmp_path, "session")
    files.write("old", {"x": 1})
    files.rename("old", "new")
    assert fsynced_after_each_rename(events), events


def test_a_folder_that_refuses_fsync_still_saves(tmp_path, monkeypatch):
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(22, "Invalid argument")  # as some filesystems answer for a directory
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    JsonFiles(tmp_path, "session").write("r", {"x": 1})
    KVDisk(tmp_path / "kv", {}).write_manifest(KEY, {"namespace": NS, "persistent": True, "tokens": [], "pieces": []})
    assert (tmp_path / "kv" / KEY / "manifest.json").exists()
