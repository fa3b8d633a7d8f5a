"""kernels.cpu_extension.Extension, the build-once holder every C++ wrapper
uses: what it asks of torch's builder and keeps of its answer, with the builder
stubbed by a recorder (nothing is compiled). The real builds, which must
succeed on x86, are tests/test_kernel_cpu_build.py's."""
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from agentkv.kernels import cpu_extension
from agentkv.kernels.cpu_extension import CpuKernelUnavailable, Extension, cpu_tag, host_isas, isa


@pytest.fixture(autouse=True)
def _own_build_root(monkeypatch, tmp_path):
    # Extension makes its build folder before building: not in the user's cache.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))


def _stubbed_builder(monkeypatch, error: Exception | None = None) -> list[dict]:
    calls: list[dict] = []

    def build(**kwargs):
        calls.append(kwargs)
        if error is not None:
            raise error

    monkeypatch.setattr(torch.utils.cpp_extension, "load", build)
    return calls


def test_a_build_runs_once_and_its_lookup_is_kept(monkeypatch):
    calls = _stubbed_builder(monkeypatch)
    found = object()
    lookups = []
    ext = Extension("agentkv_test", Path("/src/test_op.cpp"), "agentkv_test", lambda library: lookups.append(1) or found, cflags=["-DX"])
    assert ext.build_error() == ""
    assert ext.load() is found and ext.load() is found and ext.available()
    assert len(calls) == 1 and len(lookups) == 1
    assert calls[0]["name"].startswith(f"agentkv_test_{isa()}_{cpu_tag()}_")
    assert calls[0]["sources"] == ["/src/test_op.cpp"]
    assert calls[0]["extra_cflags"][-1] == "-DX" and f"-DAGENTKV_ISA={isa()}" in calls[0]["extra_cflags"]
    assert ext.build_error() == ""


@pytest.mark.parametrize("error", [OSError("no g++"), RuntimeError("ninja is required"), AttributeError("no op")])
def test_a_failed_build_is_tried_once_and_its_error_kept(monkeypatch, error):
    calls = _stubbed_builder(monkeypatch, error)
    ext = Extension("agentkv_test", Path("/src/test_op.cpp"), "agentkv_test", lambda library: None)
    with pytest.raises(CpuKernelUnavailable, match="building test_op.cpp failed") as raised:
        ext.load()
    assert raised.value.__cause__ is error
    assert not ext.available()
    with pytest.raises(CpuKernelUnavailable, match=str(error)):
        ext.load()
    assert len(calls) == 1
    assert str(error) in ext.build_error() and "needs a C++ compiler and ninja" in ext.build_error()


def test_a_set_error_stands_for_a_failed_build_even_after_a_load(monkeypatch):
    _stubbed_builder(monkeypatch)
    ext = Extension("agentkv_test", Path("/src/test_op.cpp"), "agentkv_test", lambda library: "op")
    assert ext.load() == "op"
    monkeypatch.setattr(ext, "error", "no g++ here")
    assert not ext.available() and ext.build_error() == "no g++ here"
    with pytest.raises(CpuKernelUnavailable, match="no g\\+\\+ here"):
        ext.load()


def test_a_header_change_is_a_new_build(monkeypatch, tmp_path):
    # torch rebuilds when a source changes, not when a header it includes does.
    calls = _stubbed_builder(monkeypatch)
    header = tmp_path / "shared.h"
    header.write_text("inline int f() { return 1; }\n")
    names = []
    for text in (None, "inline int f() { return 2; }\n"):
        if text is not None:
            header.write_text(text)
        ext = Extension("agentkv_test", tmp_path / "op.cpp", "agentkv_test", lambda library: "op", headers=[header])
        ext.load()
        names.append(calls[-1]["name"])
    assert names[0] != names[1] and all(n.startswith(f"agentkv_test_{isa()}_{cpu_tag()}_") for n in names)


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next(monkeypatch, tmp_path):
    # torch waits on its `lock` file for as long as it exists; a build killed
    # midway (Ctrl-C at first use) left one, and every later start hung.
    seen = []
    ext = Extension("agentkv_test", tmp_path / "op.cpp", "agentkv_test", lambda library: "op")
    directory = ext.build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "lock").write_text("")

    def build(**kwargs):
        seen.append((kwargs["build_directory"], (directory / "lock").exists()))

    monkeypatch.setattr(torch.utils.cpp_extension, "load", build)
    assert ext.load() == "op"
    assert seen == [(str(directory), False)]
    assert directory.is_relative_to(tmp_path) and ext.build_name() in directory.name


def test_each_isa_is_a_build_of_its_own_under_a_library_of_its_own(monkeypatch):
    calls = _stubbed_builder(monkeypatch)
    libraries = []
    ext = Extension("agentkv_test", Path("/src/test_op.cpp"), "agentkv_test", lambda library: libraries.append(library) or library)
    for target in host_isas():
        monkeypatch.setenv("AGENTKV_CPU_ISA", target)
        isa()  # read once a forward (dispatch.select); kernels run the ISA it read last
        assert ext.load() == f"agentkv_test_{target}" and ext.load() == f"agentkv_test_{target}"
    assert len(calls) == len(host_isas()) == len(libraries)
    for call, target in zip(calls, host_isas()):
        assert f"-DAGENTKV_ISA={target}" in call["extra_cflags"]
        assert all(flag in call["extra_cflags"] for flag in cpu_extension.ISA_FLAGS[target])
        assert call["name"].startswith(f"agentkv_test_{target}_")
    assert len({c["build_directory"] for c in calls}) == len(calls)


def test_the_isa_is_the_best_the_cpu_has_unless_a_lower_one_is_asked(monkeypatch):
    monkeypatch.delenv("AGENTKV_CPU_ISA", raising=False)
    assert isa() == host_isas()[0]
    monkeypatch.setenv("AGENTKV_CPU_ISA", "auto")
    assert isa() == host_isas()[0]
    for bad in ("avx1024", "AVX2", ""):
        monkeypatch.setenv("AGENTKV_CPU_ISA", bad)
        with pytest.raises(ValueError, match="AGENTKV_CPU_ISA"):
            isa()


@pytest.mark.parametrize("flags, expected", [
    ({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "f16c", "bmi1", "bmi2"},
     ("avx512", "avx2")),
    ({"avx2", "fma", "f16c", "bmi1", "bmi2", "avx"}, ("avx2",)),
    ({"avx512f", "avx2", "fma", "f16c", "bmi1", "bmi2"}, ("avx2",)),  # AVX512F alone (Xeon Phi) is not x86-64-v4
    ({"sse4_2"}, ("native",)),
    (set(), ("native",)),  # no /proc/cpuinfo (another OS) or no x86
])
def test_host_isas_follow_the_cpu_flags(monkeypatch, flags, expected):
    monkeypatch.setattr(cpu_extension, "_cpu_flags", lambda: flags)
    assert host_isas() == expected


def test_a_moved_torch_is_a_build_of_its_own(monkeypatch, tmp_path):
    import torch

    ext = Extension("agentkv_test", tmp_path / "op.cpp", "agentkv_test", lambda library: "op")
    here = ext.build_directory()
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "elsewhere" / "torch" / "__init__.py"))
    assert ext.build_directory() != here and ext.build_directory().name == here.name
