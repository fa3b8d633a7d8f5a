"""One import root: the checkout's folders are agentkv.kernels, agentkv.model,
... and never bare top-level names, which would shadow installed packages
(transformers imports PyPI's `kernels`). Each check runs in a fresh
interpreter, from the directory the case is about, as a user would."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BARE = ["kernels", "model", "cache", "engine", "spec", "profiling", "experiments", "serve"]


def run_python(code: str, cwd: Path, python: str = sys.executable) -> str:
    proc = subprocess.run([python, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_transformers_llama_builds_from_the_repository_root():
    # transformers imports PyPI's `kernels` (hub_kernels) as soon as a Llama
    # model is built; from the root our kernels/ must not answer it.
    out = run_python("""
        import kernels
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=64)
        model = LlamaForCausalLM(cfg)
        print(kernels.__file__)
        print(sum(p.numel() for p in model.parameters()))
    """, cwd=ROOT)
    kernels_file, params = out.split()
    assert not Path(kernels_file).resolve().is_relative_to(ROOT)
    assert int(params) > 0


@pytest.mark.parametrize("name", BARE)
def test_no_folder_of_the_checkout_is_a_bare_name(name):
    out = run_python(f"""
        import importlib
        try:
            module = importlib.import_module({name!r})
        except ModuleNotFoundError as e:
            print("missing", e.name)
        else:
            print("found", module.__file__)
    """, cwd=ROOT)
    kind, what = out.split(maxsplit=1)
    if kind == "missing":
        assert what.strip() == name
    else:  # another package of that name (PyPI's kernels), never ours
        assert not Path(what.strip()).resolve().is_relative_to(ROOT)


def test_bare_submodule_imports_fail_from_the_root():
    out = run_python("""
        for name in ("engine.engine", "model.llama", "cache.pool", "spec.ngram", "experiments.workloads.workflows"):
            try:
                __import__(name)
            except ModuleNotFoundError:
                print("refused", name)
    """, cwd=ROOT)
    assert out.split().count("refused") == 5


@pytest.mark.slow
def test_the_installed_engine_imports_from_another_directory(tmp_path):
    out = run_python("""
        import agentkv
        from agentkv import Engine, KVCapacityError
        from agentkv.kernels import cpu_linear
        from agentkv.model.default import small_model_dir
        print(agentkv.__file__)
        print(Engine.__module__, KVCapacityError.__module__)
        print(cpu_linear.SOURCE.is_file(), (small_model_dir() / "model.safetensors").is_file())
    """, cwd=tmp_path)
    init, modules, files = out.strip().split("\n")
    assert Path(init).name == "__init__.py"
    assert modules == "agentkv.engine.engine agentkv.cache.errors"  # engine.errors re-exports it
    assert files == "True True"


def test_importing_agentkv_does_not_import_the_engine(tmp_path):
    # The front door loads the engine on first use: a subpackage alone
    # (a kernel's reference, say) must not pull the engine in.
    out = run_python("""
        import sys
        import agentkv.kernels.reference
        print(any(m.startswith("agentkv.engine") for m in sys.modules))
    """, cwd=tmp_path)
    assert out.strip() == "False"


# Both install kinds from this checkout, each in an environment of its own
# (no dependencies: the package's own import needs none), checked from
# another directory: the package is the checkout's (editable) or a copy
# with its data files (regular).
INSTALLED = """
    import importlib.util, pathlib
    import agentkv
    root = pathlib.Path(agentkv.__file__).parent
    print(root)
    for sub in ("kernels.dispatch", "model.llama", "cache.pool", "engine.engine", "engine.api", "spec.ngram",
                "profiling.breakdown", "experiments.benchmarks.bench_agents", "experiments.drivers.servers", "serve"):
        assert importlib.util.find_spec("agentkv." + sub) is not None, sub
    for data in ("models/agent-8m/model.safetensors", "models/agent-8m/tokenizer.json",
                 "models/smollm2-agent/adapter.safetensors", "models/smollm2-agent/chat_template.jinja", "kernels/cpu_linear.cpp",
                 "kernels/cpu_attention.h", "experiments/workloads/data/workloads.json",
                 "experiments/drivers/peers/setup_vllm.sh", "profiling/gpu_check.sh"):
        assert (root / data).is_file(), data
"""


@pytest.mark.parametrize("editable", [True, False], ids=["editable", "regular"])
@pytest.mark.slow
def test_install_kinds(tmp_path, editable):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    cmd = [python, "-m", "pip", "install", "-q", "--no-deps", *(["-e"] if editable else []), str(ROOT)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = Path(run_python(INSTALLED, cwd=tmp_path, python=python).strip())
    if editable:
        assert where == ROOT
    else:
        assert where.is_relative_to(venv) and not (where / "tests").exists()


def test_every_package_folder_is_installed():
    # An editable checkout imports a new subpackage that `pip install .` would leave out.
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        ".".join(("agentkv", *init.parent.relative_to(ROOT).parts))
        for init in ROOT.rglob("__init__.py")
        if not any(part.startswith(".") or part in ("tests", "build") for part in init.relative_to(ROOT).parts)
    }
    assert folders <= listed, sorted(folders - listed)
