"""Building the C++ CPU kernels (kernels/cpu_*.cpp) on first use.

Each is compiled with torch.utils.cpp_extension for a vector ISA this CPU
runs and cached under TORCH_EXTENSIONS_DIR (or ~/.cache/torch_extensions)/agentkv;
a machine without a C++ compiler or ninja gets CpuKernelUnavailable,
remembered so the build is tried once, and the caller falls back to its
torch path. Each wrapper (kernels/cpu_*.py) holds its Extension as
`extension` and passes on its build_error (and available) as its own.

The ISA (isa()) is the best this CPU has: avx512 (built -march=native, so
with AVX512-BF16 or AMX where the CPU has them), avx2 (x86-64-v3: AVX2, FMA,
F16C; the same code on any such CPU), or native off x86. AGENTKV_CPU_ISA
picks a lower one (avx2 on an AVX-512 host, as the tests do to cover both
paths on one machine). Each ISA's build registers its torch library under
its own name (kernels/cpu_library.h), so builds for two ISAs load side by
side in one process.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")

# What the two attention kernels share (vectors, exp, argument checks).
ATTENTION_HEADER = Path(__file__).with_name("cpu_attention.h")
# The ISA-named torch library every kernel registers.
LIBRARY_HEADER = Path(__file__).with_name("cpu_library.h")
# The tile unit's grant and shape (the linear and chunk attention kernels).
AMX_HEADER = Path(__file__).with_name("cpu_amx.h")


class CpuKernelUnavailable(RuntimeError):
    """A C++ CPU extension could not be built or loaded here."""


# Compiler flags per ISA, best first. avx2 is x86-64-v3 rather than native so
# that an AVX-512 host forced onto it compiles what an AVX2-only host runs.
ISA_FLAGS = {
    "avx512": ("-march=native",),
    "avx2": ("-march=x86-64-v3", "-mtune=native"),
    "native": ("-march=native",),
}
# What each needs of /proc/cpuinfo's flags (x86-64-v4's and v3's vector parts).
_ISA_NEEDS = {
    "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c", "bmi1", "bmi2"},
}


def _cpu_flags() -> set[str]:
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.partition(":")[2].split())


def host_isas() -> tuple[str, ...]:
    """The ISAs this CPU runs, best first: ('avx512', 'avx2') on an AVX-512
    host, ('avx2',) on an AVX2 one, ('native',) anywhere else."""
    flags = _cpu_flags()
    found = tuple(name for name, needs in _ISA_NEEDS.items() if needs <= flags)
    return found or ("native",)


def isa() -> str:
    """The ISA the kernels are built for and run: AGENTKV_CPU_ISA (auto, or
    one of host_isas()), the best this CPU has by default. Read here, once a
    forward (dispatch.select calls it), and remembered for the kernels'
    calls (current_isa): a step calls the kernels a few hundred times, and an
    environment read each time would add up."""
    global _current
    wanted = os.environ.get("AGENTKV_CPU_ISA", "auto")
    isas = _host_isas()
    if wanted == "auto":
        _current = isas[0]
    elif wanted in isas:
        _current = wanted
    else:
        raise ValueError(f"AGENTKV_CPU_ISA must be auto or one of this CPU's {', '.join(isas)}, not {wanted!r}")
    return _current


def current_isa() -> str:
    """The ISA isa() read last (reading it on the first call)."""
    return _current or isa()


_host_isas = functools.cache(host_isas)
_current = ""


def cpu_tag() -> str:
    """A short hash of this CPU's feature flags. -march=native code runs only
    on CPUs with the same features: builds are cached per feature set, so a
    shared cache never hands one CPU another's binary."""
    return hashlib.sha1(" ".join(sorted(_cpu_flags())).encode()).hexdigest()[:10]


class Extension(Generic[T]):
    """One C++ extension (kernels/cpu_*.cpp), built and loaded on its first
    use for each ISA (isa()). What it gives (resolve(library)'s lookup of what
    it registered in torch library `library`, its torch.ops or class) or the
    error that stopped its build is kept, so the build is tried once per
    process and ISA."""

    def __init__(
        self, name: str, source: Path, library: str, resolve: Callable[[str], T], cflags: Sequence[str] = (),
        headers: Sequence[Path] = (),
    ) -> None:
        self.name = name
        self.source = source
        self.library = library  # the torch library the source registers, without its ISA (cpu_library.h)
        self.resolve = resolve
        self.cflags = tuple(cflags)  # added to the common ones
        # Headers the source includes (beside it). torch rebuilds when a
        # source changes but not a header, so their text is in build_name.
        self.headers = (LIBRARY_HEADER, *headers)
        # Why the build failed ('' when it has not). Read before the loaded
        # op, so that setting it stands for a machine without a compiler even
        # where the extension is built (the tests of the fallbacks do).
        self.error = ""
        self._loaded: dict[str, T] = {}

    def load(self) -> T:
        """What resolve looks up for current_isa(), building the extension
        on the first call for it; CpuKernelUnavailable when it cannot be built."""
        if self.error:
            raise CpuKernelUnavailable(self.error)
        target = current_isa()
        loaded = self._loaded.get(target)
        if loaded is None:
            loaded = self._loaded[target] = self._build(target)
        return loaded

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

    def build_name(self, target: str | None = None) -> str:
        """The name torch builds and caches the extension under for an ISA
        (isa() by default): per ISA, per CPU feature set (cpu_tag, since
        -march=native code runs only where the features match) and per the
        contents of the headers it includes."""
        name = f"{self.name}_{target or isa()}_{cpu_tag()}"
        return name + "_" + hashlib.sha1(b"".join(h.read_bytes() for h in self.headers)).hexdigest()[:10]

    def build_directory(self, target: str | None = None) -> Path:
        """Where the build and its cached library live: under torch's build
        root (TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions), per Python,
        torch version and torch installation (a moved or another venv builds
        anew), then per build_name."""
        import torch
        from torch.utils.cpp_extension import get_default_build_root

        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
        where = hashlib.sha1(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:8]
        version = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}_{where}"
        return Path(root) / "agentkv" / version / self.build_name(target)

    def _build(self, target: str) -> T:
        try:
            from torch.utils.cpp_extension import load as build

            directory = self.build_directory(target)
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
                    name=self.build_name(target),
                    sources=[str(self.source)],
                    extra_cflags=["-O3", *ISA_FLAGS[target], f"-DAGENTKV_ISA={target}", "-fopenmp", *self.cflags],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(directory),
                    is_python_module=False,
                )
            return self.resolve(f"{self.library}_{target}")
        except (RuntimeError, OSError, ImportError, AttributeError, subprocess.CalledProcessError) as e:
            self.error = f"building {self.source.name} failed (needs a C++ compiler and ninja): {e}"
            raise CpuKernelUnavailable(self.error) from e
