"""The package's import structure, read from the source: layers call down,
no module imports itself back through a loop, the HTTP layer enters the
engine only through its front door (agentkv.engine), and the product never
imports the experiments or the profilers, nor the profilers a benchmark."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["serve", "engine.api", "engine", "spec", "cache", "model", "kernels"]  # top calls down
TOOLING = ("agentkv.experiments", "agentkv.profiling")  # above the product: they use it, it never uses them
BENCHMARKS = "agentkv.experiments.benchmarks"


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "build") or rel.parts[0].startswith("."):
            continue
        name = ".".join(("agentkv", *rel.with_suffix("").parts)).removesuffix(".__init__")
        out[name] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules this file imports (TYPE_CHECKING imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("agentkv"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
    return found & known.keys()


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer(module: str) -> int | None:
    rest = module.removeprefix("agentkv.")
    for i, name in enumerate(LAYERS):
        if rest == name or rest.startswith(name + "."):
            return i
    return None


@functools.cache  # the source is read once for all the checks
def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items()}


def test_no_import_cycles():
    g = graph()
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        for n in sorted(g[m]):
            visit(n, path + [m])
        done.add(m)

    for m in sorted(g):
        visit(m, [])


def test_layers_call_down():
    up = [(m, n) for m, targets in graph().items() for n in targets
          if layer(m) is not None and layer(n) is not None and layer(n) < layer(m)]
    assert not up, f"imports that run up a layer: {up}"


def test_http_layer_enters_the_engine_by_its_front_door():
    through = [(m, n) for m, targets in graph().items() if m.startswith("agentkv.engine.api")
               for n in targets if n != "agentkv.engine" and not n.startswith("agentkv.engine.api")]
    assert not through, f"engine/api imports around agentkv.engine: {through}"


def test_the_product_imports_no_experiment_or_profiler():
    # serve.py starts the demo by name (runpy), never by importing it.
    into = [(m, n) for m, targets in graph().items() if layer(m) is not None
            for n in targets if any(under(n, t) for t in TOOLING)]
    assert not into, f"product modules that import experiments or profiling: {into}"


def test_the_profilers_import_no_benchmark():
    # Profiling shares experiments' helpers (common, report, drivers, workloads), never a benchmark.
    into = [(m, n) for m, targets in graph().items() if under(m, "agentkv.profiling")
            for n in targets if under(n, BENCHMARKS)]
    assert not into, f"profiling modules that import a benchmark: {into}"


def test_the_checks_see_the_code():
    # A check that read nothing could not fail.
    g = graph()
    assert len(g) > 150
    assert "agentkv.engine" in g["agentkv.engine.api.chat"]
    assert "agentkv.engine.turn" in g["agentkv.engine.engine"]
    assert "agentkv.experiments.benchmarks.bench_replay" in g["agentkv.experiments.benchmarks.demo"]
    assert "agentkv.experiments.common" in g["agentkv.profiling.breakdown"]  # an import inside a function
