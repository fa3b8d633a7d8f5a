"""Building the C++ CPU kernels (kernels/cpu_*.cpp) on first use.

Each is compiled with torch.utils.cpp_extension for the CPU it runs on and
cached under TORCH_EXTENSIONS_DIR (or ~/.cache/torch_extensions); a machine
without a C++ compiler or ninja gets CpuKernelUnavailable, remembered so the
build is tried once, and the caller falls back to its torch path.
"""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


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


def load(state: dict, name: str, source: Path, resolve: Callable[[], T], cflags: Sequence[str] = ()) -> T:
    """Build and load `source` as extension `name` (once: the result, or the
    error, is kept in the caller's `state`), then return resolve(), which
    looks up what the extension registered (its torch.ops); cflags are added
    to the common ones."""
    if "op" in state:
        return state["op"]
    if "error" in state:
        raise CpuKernelUnavailable(state["error"])
    try:
        from torch.utils.cpp_extension import load as build

        build(
            name=f"{name}_{cpu_tag()}",
            sources=[str(source)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", *cflags],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
        state["op"] = resolve()
    except (RuntimeError, OSError, ImportError, AttributeError, subprocess.CalledProcessError) as e:
        state["error"] = f"building {source.name} failed (needs a C++ compiler and ninja): {e}"
        raise CpuKernelUnavailable(state["error"]) from e
    return state["op"]
