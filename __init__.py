"""agentkv: a stateful LLM inference engine for multi-agent tool calling.

    from agentkv import Engine

    engine = Engine.from_pretrained()  # the embedded default model
    print(engine.chat([{"role": "user", "content": "hi"}]).text)

The repository's top-level folders are this package's subpackages
(agentkv.kernels is kernels/, agentkv.model is model/, ...): pyproject.toml
maps the package to the repository root, so `pip install -e .` (to work on
it) and `pip install .` give the same tree.

The engine's names are loaded on first use, so that importing one
subpackage (agentkv.kernels.reference, say) does not import the engine.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from typing import Callable

_EXPORTS = {
    "Engine": "agentkv.engine.engine",
    "TurnResult": "agentkv.engine.turn",
    "Conversation": "agentkv.engine.turn",
    "Session": "agentkv.engine.session",
    "EngineError": "agentkv.engine.errors",
    "InvalidRequestError": "agentkv.engine.errors",
    "ContextLengthError": "agentkv.engine.errors",
    "KVCapacityError": "agentkv.engine.errors",
    "SessionBusyError": "agentkv.engine.errors",
    "SessionClosedError": "agentkv.engine.errors",
    "ModelLoadError": "agentkv.engine.errors",
    "UnsupportedModelError": "agentkv.engine.errors",
}

__all__ = [*_EXPORTS, "lazy_exports", "step_aside"]


def lazy_exports(module: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """__getattr__ and __dir__ for a module whose names (name -> the module
    defining it) are imported on first use, then kept."""

    def getattr_(name: str) -> object:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[module], name, value)
        return value

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[module]), *exports})

    return getattr_, dir_


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


def step_aside(name: str) -> None:
    """Give a bare top-level name back to whatever else provides it.

    Python puts the directory it starts from on sys.path (`python -m pytest`,
    `python serve.py`, a notebook in the checkout), so the checkout's folders
    would answer bare imports: `import kernels` inside transformers would get
    our kernels/ instead of PyPI's `kernels`. Each top-level __init__.py
    calls this when it is imported under its bare name: the module replaces
    itself in sys.modules (which the import system honours) with the module
    of that name found on sys.path without the checkout, or the import fails
    with ModuleNotFoundError. Either way nothing of ours loads under it.
    """
    ours = sys.modules.pop(name)
    package = ours.__spec__.submodule_search_locations is not None
    checkout = Path(ours.__file__).resolve().parents[1 if package else 0]
    path = [p for p in sys.path if Path(p or ".").resolve() != checkout]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None:
        raise ModuleNotFoundError(
            f"No module named {name!r} (this checkout's {name}{'/' if package else '.py'} is imported as agentkv.{name}; "
            "`pip install -e .` installs it)", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        if spec.loader is not None:  # None: a namespace package, which has nothing to run
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
