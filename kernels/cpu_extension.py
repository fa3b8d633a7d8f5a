"""Building the C++ CPU kernels (kernels/cpu_*.cpp) on first use.

Each is compiled with torch.utils.cpp_extension for the CPU it runs on and
cached under TORCH_EXTENSIONS_DIR (or ~/.cache/torch_extensions)/agentkv; a machine
without a C++ compiler or ninja gets CpuKernelUnavailable, remembered so the
build is tried once, and the caller falls back to its torch path. Each
wrapper (kernels/cpu_*.py) holds its Extension as `extension` and passes on
its build_error (and available) as its own.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")

# What the two attention kernels share (vectors, exp, argument checks).
ATTENTION_HEADER = Path(__file__).with_name("cpu_attention.h")


class CpuKernelUnavailable(RuntimeError):
    """A C++ CPU extension could not be built or loaded here."""


def cpu_tag() -> str:
    """A short hash of this CPU's feature flags. -march=native code runs only
    on CPUs with the same features: builds are cached per feature set, so a
    shared cache never hands one CPU another's binary."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


class Extension(Generic[T]):
    """One C++ extension (kernels/cpu_*.cpp), built and loaded on its first
    use. What it gives (resolve()'s lookup of what it registered, its
    torch.ops or class) or the error that stopped its build is kept, so the
    build is tried once per process."""

    def __init__(
        self, name: str, source: Path, resolve: Callable[[], T], cflags: Sequence[str] = (), headers: Sequence[Path] = ()
    ) -> None:
        self.name = name
        self.source = source
        self.resolve = resolve
        self.cflags = tuple(cflags)  # added to the common ones
        # Headers the source includes (beside it). torch rebuilds when a
        # source changes but not a header, so their text is in build_name.
        self.headers = tuple(headers)
        # Why the build failed ('' when it has not). Read before the loaded
        # op, so that setting it stands for a machine without a compiler even
        # where the extension is built (the tests of the fallbacks do).
        self.error = ""
        self._loaded: T | None = None

    def load(self) -> T:
        """What resolve looks up, building the extension on the first call;
        CpuKernelUnavailable when it cannot be built."""
        if self.error:
            raise CpuKernelUnavailable(self.error)
        if self._loaded is None:
            self._loaded = self._build()
        return self._loaded

    def build_error(self) -> str:
        """Why the extension is not available ('' when it is, or not tried yet)."""
        return self.error

    def available(self) -> bool:
        """Whether the extension is built (building it on the first call)."""
        try:
            self.load()
        except CpuKernelUnavailable:
            return False
        return True

    def build_name(self) -> str:
        """The name torch builds and caches the extension under: per CPU
        feature set (cpu_tag) and, with headers, per their contents."""
        name = f"{self.name}_{cpu_tag()}"
        if self.headers:
            name += "_" + hashlib.sha1(b"".join(h.read_bytes() for h in self.headers)).hexdigest()[:10]
        return name

    def build_directory(self) -> Path:
        """Where the build and its cached library live: under torch's build
        root (TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions), per Python
        and torch version, then per build_name."""
        import torch
        from torch.utils.cpp_extension import get_default_build_root

        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
        version = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
        return Path(root) / "agentkv" / version / self.build_name()

    def _build(self) -> T:
        try:
            from torch.utils.cpp_extension import load as build

            directory = self.build_directory()
            directory.mkdir(parents=True, exist_ok=True)
            # torch marks a build in progress with a `lock` file that other
            # processes wait on for as long as it exists, and a process killed
            # mid-build (a Ctrl-C at first use) leaves it behind: every later
            # start then hangs. Our builds take an flock first, which the OS
            # releases with its holder, so a `lock` found while holding it is
            # such a leftover.
            with open(directory.with_name(directory.name + ".flock"), "w") as held:
                fcntl.flock(held, fcntl.LOCK_EX)
                (directory / "lock").unlink(missing_ok=True)
                build(
                    name=self.build_name(),
                    sources=[str(self.source)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", *self.cflags],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(directory),
                    is_python_module=False,
                )
            return self.resolve()
        except (RuntimeError, OSError, ImportError, AttributeError, subprocess.CalledProcessError) as e:
            self.error = f"building {self.source.name} failed (needs a C++ compiler and ninja): {e}"
            raise CpuKernelUnavailable(self.error) from e
