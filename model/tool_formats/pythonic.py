"""Pythonic calls (Llama 3.2 and Llama 4's pythonic templates, Gemma 3's
common tool prompt): the whole reply is a Python list of calls with keyword
arguments, `[get_weather(city="Paris"), now()]`, on Llama 4 optionally
between `<|python_start|>` and `<|python_end|>`, on Gemma optionally in a
```tool_code fence.

Read with Python's own parser, never evaluated: only literals are arguments
(JSON's true/false/null too, which templates that render arguments with
tojson teach the model).
"""
from __future__ import annotations

import ast
import math
import re

from agentkv.model.tool_formats.base import ToolCallFormat

_WRAPPERS = re.compile(r"\A(?:<\|python_start\|>(?P<a>.*?)(?:<\|python_end\|>)?|```tool_code\n(?P<b>.*?)\n?```)\Z",
                       re.DOTALL)
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> object:
    """A JSON value written as a Python literal; ValueError on anything else
    (a set, bytes, an expression: nothing a client could receive as JSON)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        number = _literal(node.operand)
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError("a sign before a non-number")
        return -number if isinstance(node.op, ast.USub) else number
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("not a JSON number")
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict key that is not a string")
        return {k: _literal(v) for k, v in zip(keys, node.values)}
    raise ValueError(f"not a literal: {type(node).__name__}")


def _call(node: ast.expr) -> dict | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if any(k.arg is None for k in node.keywords):  # **kwargs
        return None
    try:
        return {"name": node.func.id, "arguments": {k.arg: _literal(k.value) for k in node.keywords}}
    except (ValueError, RecursionError):
        return None


def read(text: str) -> tuple[str, list[dict]]:
    body = text.strip()
    if (wrapped := _WRAPPERS.match(body)) is not None:
        body = (wrapped["a"] if wrapped["a"] is not None else wrapped["b"]).strip()
    if not body.startswith("[") or not body.endswith("]"):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return text, []
    if not isinstance(tree, ast.List) or not tree.elts:
        return text, []
    calls = [_call(e) for e in tree.elts]
    return ("", calls) if None not in calls else (text, [])


PYTHONIC = ToolCallFormat("pythonic", "", "{name}(", ")", ", ", "[", "[", read, list_open="[", list_close="]",
                          quoted_name=False, python_arguments=True, mapping_arguments=True)
