"""The second KV tier's disk format (cache.kv_tier).

One folder per entry, named by its key: safetensors files of pieces, each
written once and never changed (a piece's tensors are named p<i>.<part>),
and manifest.json naming, for every piece in order, its file, name, size
and CRC32, beside the entry's tokens, namespace, the identity of the model
and layout the KV belongs to, and an id of its own. A manifest is replaced
atomically (temporary file, fsync, rename, fsync of the folder) after the
files it names were fsynced, so a kill -9 or a crash leaves the previous
manifest or the new one, each naming complete files. A piece is verified
against its CRC whenever it is read.

Several processes may write one folder (replicas sharing a state
directory, engine.api.cluster), each through a KVDisk of its own: every
file a writer creates, temporary or not, has a name no other writer uses.
The manifest on disk is the last writer's; cleanup never removes a file
it names, nor a file of another writer younger than GRACE_S (its manifest
may not be written yet).
"""
from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import shutil
import time
import uuid
import zlib
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MANIFEST = "manifest.json"
# Longer than any writer takes from its first piece to the manifest naming it: a file of another
# writer that no manifest names and is this young may be named by the next one.
GRACE_S = 600.0


class DiskWriteError(OSError):
    """Writing to the disk tier failed (a full or failing disk, a path in
    the way): what was on disk before stays as it was."""


class CorruptKV(Exception):
    """A piece or manifest on disk that cannot be trusted."""


def crc(parts: dict[str, torch.Tensor]) -> int:
    value = 0
    for name in sorted(parts):
        value = zlib.crc32(parts[name].contiguous().view(torch.uint8).numpy(), value)
    return value


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """fsync a folder, so that a name just renamed or created in it survives
    a crash. Skipped where the platform cannot open a folder (Windows) or
    its filesystem cannot fsync one."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def replace_durably(path: Path, data: bytes, tmp: Path) -> os.stat_result:
    """Replace path's content with data so that a kill -9 or a crash leaves
    the old file or the new one: written to tmp (a name no other writer of
    the folder uses), fsynced, renamed over path, the folder fsynced. On an
    error tmp is removed and the error raised. Returns the new file's stat."""
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            st = os.fstat(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a name never reused: left, it would stay for good
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return st


class KVDisk:
    def __init__(self, root: str | Path, identity: dict):
        self.root, self.identity = Path(root), identity
        self.root.mkdir(parents=True, exist_ok=True)
        # Begins the name of every file this writer creates: a pid alone repeats on other machines
        # sharing the folder, and in another KVDisk of this process.
        self.writer = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._serial = itertools.count()

    def _folder(self, key: str) -> Path:
        return self.root / key

    def _new_name(self, suffix: str = "") -> str:
        return f"{self.writer}-{next(self._serial)}{suffix}"

    def _make(self, folder: Path) -> None:
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.root)  # else a crash may lose the folder's name, and all in it

    def write_pieces(self, key: str, pieces: list[dict[str, torch.Tensor]]) -> tuple[str, list[tuple[str, int]]]:
        """One new file holding these pieces: its name, and the pieces' (name,
        crc). DiskWriteError if it cannot be written."""
        folder = self._folder(key)
        filename = self._new_name(".safetensors")
        tensors, out = {}, []
        for i, parts in enumerate(pieces):
            out.append((f"p{i}", crc(parts)))
            tensors.update({f"p{i}.{k}": v.contiguous() for k, v in parts.items()})
        try:
            self._make(folder)
            save_file(tensors, str(folder / filename))
            _fsync(folder / filename)
        except Exception as err:  # OSError, or safetensors' own error type for the same faults
            with contextlib.suppress(OSError):  # no half-written file left behind
                (folder / filename).unlink(missing_ok=True)
            raise DiskWriteError(f"cannot write {key}/{filename}: {err}") from err
        return filename, out

    def write_manifest(self, key: str, manifest: dict) -> str:
        """Replace the entry's manifest; returns the new one's id. Files no
        manifest names any more go (see the module's docstring). DiskWriteError
        if it cannot be written (the old manifest stays)."""
        folder = self._folder(key)
        tmp = folder / self._new_name(".tmp")
        manifest_id = self._new_name()
        try:
            self._make(folder)
            replace_durably(folder / MANIFEST,
                            json.dumps({**manifest, "id": manifest_id, "identity": self.identity}).encode(), tmp)
        except OSError as err:
            raise DiskWriteError(f"cannot write {key}/{MANIFEST}: {err}") from err
        self._sweep(folder, {p["file"] for p in manifest["pieces"]})
        return manifest_id

    def _sweep(self, folder: Path, named: set[str]) -> None:
        """Remove the folder's pieces and temporary files that neither named
        nor the manifest on disk names, if they are this writer's or older
        than GRACE_S."""
        old = time.time() - GRACE_S
        stale = []
        for f in itertools.chain(folder.glob("*.safetensors"), folder.glob("*.tmp")):
            with contextlib.suppress(OSError):  # removed meanwhile by another writer's sweep
                if f.name not in named and (f.name.startswith(self.writer + "-") or f.stat().st_mtime < old):
                    stale.append(f)
        if stale:  # read only now: another writer may have replaced the manifest since
            on_disk = _files_of(self._current(folder))
            for f in stale:
                if f.name not in on_disk:
                    with contextlib.suppress(OSError):
                        f.unlink(missing_ok=True)

    def _current(self, folder: Path) -> dict:
        """The manifest on disk; {} if there is none or it cannot be read."""
        try:
            m = json.loads((folder / MANIFEST).read_text())
        except (OSError, ValueError):
            return {}
        return m if isinstance(m, dict) else {}

    def read_piece(self, key: str, filename: str, name: str, expected_crc: int | None) -> dict[str, torch.Tensor]:
        path = self._folder(key) / filename
        try:
            with safe_open(str(path), "pt") as f:
                parts = {k.split(".", 1)[1]: f.get_tensor(k) for k in f.keys() if k.startswith(name + ".")}
        except Exception as err:  # a missing, truncated or foreign file
            raise CorruptKV(f"cannot read {path.name}: {err}") from None
        if not parts or crc(parts) != expected_crc:
            raise CorruptKV(f"checksum mismatch in {path.name} ({name})")
        return parts

    def discard(self, key: str, files: set[str], manifest_id: str | None) -> None:
        """Remove what this writer drops of an entry: its manifest if that is
        still the one it wrote or read (manifest_id), and of the files its
        entry named (files) and its own, those the manifest on disk does not
        name. What another writer saved of the entry since stays."""
        folder = self._folder(key)
        current = self._current(folder)
        if current and current.get("id") == manifest_id:
            with contextlib.suppress(OSError):
                (folder / MANIFEST).unlink(missing_ok=True)
            current = {}
        named = _files_of(current)
        for name in files - named:
            with contextlib.suppress(OSError):
                (folder / name).unlink(missing_ok=True)
        if folder.is_dir():
            self._sweep(folder, named)
            with contextlib.suppress(OSError):  # not empty: another writer's files are in it
                folder.rmdir()

    def remove(self, key: str) -> None:
        """The entry's whole folder: only where this is the disk's one writer
        (a tier that resumes what is on disk at start, cache.kv_tier.load)."""
        shutil.rmtree(self._folder(key), ignore_errors=True)

    def saved(self) -> Iterator[tuple[str, dict | None, str | None]]:
        """(key, manifest, None) for each persistent entry of this model and
        layout, (key, None, problem) for one that cannot be used. Leftovers
        of spills (entries that were not persistent) are removed."""
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            m, problem = self.manifest(folder.name)
            if m is None and problem is None:
                self.remove(folder.name)
                continue
            yield folder.name, m, problem

    def manifest(self, key: str) -> tuple[dict | None, str | None]:
        """The entry's manifest if it is persistent and of this model and
        layout; else (None, the problem), or (None, None) for a spill or
        none (a folder without a manifest included)."""
        if not self._folder(key).is_dir():
            return None, None
        try:
            m = json.loads((self._folder(key) / MANIFEST).read_text())
        except FileNotFoundError:
            # A first write cut off (a kill, a full disk) before its manifest: nothing was saved, nothing is corrupt.
            return None, None
        except (OSError, ValueError) as err:
            return None, f"unreadable manifest: {err}"
        if not m.get("persistent"):
            return None, None
        theirs = m.get("identity") or {}
        if theirs != self.identity:
            diff = sorted(k for k in set(theirs) | set(self.identity) if theirs.get(k) != self.identity.get(k))
            return None, f"saved for another model or layout (differs in {', '.join(diff)})"
        return m, None


def _files_of(manifest: dict) -> set[str]:
    try:
        return {str(p["file"]) for p in manifest.get("pieces", [])}
    except (TypeError, KeyError):  # a hand-edited manifest: it names nothing cleanup must keep
        return set()
