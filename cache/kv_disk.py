"""The second KV tier's disk format (cache.kv_tier).

One folder per entry, named by its key: safetensors files of pieces, each
written once and never changed (a piece's tensors are named p<i>.<part>),
and manifest.json naming, for every piece in order, its file, name, size
and CRC32, beside the entry's tokens, namespace and the identity of the
model and layout the KV belongs to. A manifest is replaced atomically
(temporary file, fsync, rename) after the files it names were fsynced, so a
kill -9 leaves the previous manifest or the new one, each naming complete
files. A piece is verified against its CRC whenever it is read.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MANIFEST = "manifest.json"


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


class KVDisk:
    def __init__(self, root: str | Path, identity: dict):
        self.root, self.identity = Path(root), identity
        self.root.mkdir(parents=True, exist_ok=True)

    def _folder(self, key: str) -> Path:
        return self.root / key

    def write_pieces(self, key: str, filename: str, pieces: list[dict[str, torch.Tensor]]) -> list[tuple[str, int]]:
        """One new file holding these pieces; their (name, crc). DiskWriteError if it cannot be written."""
        folder = self._folder(key)
        tensors, out = {}, []
        for i, parts in enumerate(pieces):
            out.append((f"p{i}", crc(parts)))
            tensors.update({f"p{i}.{k}": v.contiguous() for k, v in parts.items()})
        try:
            folder.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(folder / filename))
            _fsync(folder / filename)
        except Exception as err:  # OSError, or safetensors' own error type for the same faults
            with contextlib.suppress(OSError):  # no half-written file left behind
                (folder / filename).unlink(missing_ok=True)
            raise DiskWriteError(f"cannot write {key}/{filename}: {err}") from err
        return out

    def write_manifest(self, key: str, manifest: dict) -> None:
        """Replace the entry's manifest; files no piece names any more go.
        DiskWriteError if it cannot be written (the old manifest stays)."""
        folder = self._folder(key)
        tmp = folder / (MANIFEST + ".tmp")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({**manifest, "identity": self.identity}))
            _fsync(tmp)
            os.replace(tmp, folder / MANIFEST)
        except OSError as err:
            raise DiskWriteError(f"cannot write {key}/{MANIFEST}: {err}") from err
        live = {p["file"] for p in manifest["pieces"]}
        for f in folder.glob("*.safetensors"):
            if f.name not in live:
                with contextlib.suppress(OSError):  # what stays is removed by a later write
                    f.unlink(missing_ok=True)

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

    def remove(self, key: str) -> None:
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
        layout; else (None, the problem), or (None, None) for a spill or none."""
        if not self._folder(key).is_dir():
            return None, None
        try:
            m = json.loads((self._folder(key) / MANIFEST).read_text())
        except (OSError, ValueError) as err:
            return None, f"unreadable manifest: {err}"
        if not m.get("persistent"):
            return None, None
        theirs = m.get("identity") or {}
        if theirs != self.identity:
            diff = sorted(k for k in set(theirs) | set(self.identity) if theirs.get(k) != self.identity.get(k))
            return None, f"saved for another model or layout (differs in {', '.join(diff)})"
        return m, None
