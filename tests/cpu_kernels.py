"""What the tests of the C++ CPU kernels (kernels/cpu_*.py) ask of their build.

The kernels are written with x86 intrinsics: on x86 every one must build, so a
build that fails there fails the test with the compiler's message (a compile
break must not pass green on the torch fallbacks). Off x86 they cannot build,
and their tests skip saying so."""
from __future__ import annotations

import platform
from types import ModuleType
from typing import Callable, NoReturn

import pytest

X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def build_failed(error: str) -> NoReturn:
    """Fails the test with a build's error on x86; skips it elsewhere."""
    if X86:
        pytest.fail(f"a C++ kernel did not build on x86, where every one must:\n{error}", pytrace=False)
    pytest.skip(f"the C++ kernels are x86 code and this CPU is {platform.machine()}: {error}")


def require_built(*kernels: ModuleType) -> None:
    """Builds (or loads from the cache) each kernel module's extension for the
    ISA the kernels run now (cpu_extension.current_isa), or build_failed."""
    for kernel in kernels:
        if not kernel.extension.available():
            build_failed(kernel.extension.build_error())


def built_on_each_isa(*kernels: ModuleType) -> Callable:
    """An autouse fixture for a kernel test module: each test runs on each
    vector ISA this CPU runs (tests/conftest.py's cpu_isa), with the
    kernels built for it."""

    @pytest.fixture(autouse=True)
    def built(cpu_isa: str) -> None:
        require_built(*kernels)

    return built
