"""The C++ CPU kernels built for real, by the compiler, for each ISA this CPU
runs (tests/test_kernel_cpu_extension_stubbed.py stubs the builder to test the
build-once holder; nothing is stubbed here). On x86 a kernel that does not
compile fails here with the compiler's message, where the engine would run
its torch fallback and every other test could pass."""
from __future__ import annotations

import pytest

from agentkv.kernels import dispatch
from agentkv.kernels.cpu_extension import CpuKernelUnavailable, Extension
from tests.cpu_kernels import build_failed


def test_every_kernel_builds_for_each_isa(cpu_isa):
    failed = dispatch.build_cpu_kernels()
    if failed:
        build_failed("\n\n".join(f"{name}: {error}" for name, error in failed.items()))
    for kernel in dispatch.CPU_KERNELS:
        assert any(kernel.extension.build_directory(cpu_isa).glob("*.so")), kernel.__name__


def test_a_compile_error_fails_the_build_with_the_compilers_message(monkeypatch, tmp_path):
    # Built in a root of its own: a broken build must not land in the shared cache.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))
    source = tmp_path / "broken_op.cpp"
    source.write_text("int broken_op() { return no_such_name; }\n")
    ext = Extension("agentkv_broken_op", source, "agentkv_broken_op", lambda library: library)
    with pytest.raises(CpuKernelUnavailable, match="building broken_op.cpp failed") as raised:
        ext.load()
    # The compiler's diagnostic itself, with its file and line.
    message = str(raised.value)
    assert "broken_op.cpp:1:" in message and "error" in message and "no_such_name" in message
    assert ext.build_error() == message
