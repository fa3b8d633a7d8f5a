"""A tool's JSON-schema parameters as an EBNF grammar of Python keyword
arguments (`city="Paris", days=3`), for formats whose calls are Python
(model.tool_formats.pythonic). xgrammar's structural tags hold JSON to a
schema, not Python, so this writes the grammar itself.

Held: the parameter names, in the schema's order, each required one present,
no others (a tool without properties takes no arguments); each value's type
(strings double-quoted with JSON's escapes, True/False/None), enums and
consts, array items, object properties (as a dict literal with the schema's
keys). Whatever it admits, Python parses. What it cannot hold (string
patterns, formats and lengths, numeric bounds, item counts,
oneOf/allOf/not/$ref) raises a GrammarError naming it, rather than being
dropped: a request gets the constraint it asked for or a 400.
"""
from __future__ import annotations

import json
import keyword
from typing import Any

from agentkv.engine.grammar import GrammarError

__all__ = ["kwargs_grammar"]

# Keywords that describe, never constrain.
_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$schema", "$comment", "deprecated",
                          "readOnly", "writeOnly", "additionalProperties", "strict"})
_HANDLED = frozenset({"type", "enum", "const", "properties", "required", "items", "anyOf"})
_TYPES = ("string", "integer", "number", "boolean", "null", "array", "object")
_SEP = '", "'
_BASE = r'''
str ::= "\"" ([^"\\\r\n] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]))* "\""
int ::= "-"? ("0" | [1-9] [0-9]*)
num ::= int ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
bool ::= "True" | "False"
none ::= "None"
any ::= str | num | bool | none | "[" (any (", " any)*)? "]" | "{" (str ": " any (", " str ": " any)*)? "}"
'''


def _literal(value: Any) -> str:
    """A JSON value as the Python literal the grammar writes for it."""
    if isinstance(value, bool) or value is None:
        return {True: "True", False: "False", None: "None"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(map(_literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


class _Builder:
    def __init__(self, tool: str):
        self.tool = tool
        self.rules: list[str] = []

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name} ::= {body}")
        return name

    def value(self, schema: Any, where: str) -> str:
        """The rule of a value that schema allows."""
        if schema is True or schema == {}:
            return "any"
        if not isinstance(schema, dict):
            raise GrammarError(f"tool {self.tool!r}: the schema of {where} must be an object, got {schema!r}")
        unheld = sorted(set(schema) - _HANDLED - _ANNOTATIONS)
        if unheld:
            raise GrammarError(f"tool {self.tool!r}: {', '.join(unheld)} of {where} cannot be held in Python "
                               "call arguments (pythonic tool-call format)")
        if "const" in schema:
            return self.rule(json.dumps(_literal(schema["const"])))
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise GrammarError(f"tool {self.tool!r}: the enum of {where} must be a non-empty list")
            return self.rule(" | ".join(json.dumps(_literal(v)) for v in schema["enum"]))
        if "anyOf" in schema:
            return self.rule(" | ".join(self.value(s, where) for s in schema["anyOf"]))
        types = schema.get("type", list(_TYPES))
        types = [types] if isinstance(types, str) else types
        if not types or any(t not in _TYPES for t in types):
            raise GrammarError(f"tool {self.tool!r}: unknown type {schema.get('type')!r} of {where}")
        return self.rule(" | ".join(self._typed(t, schema, where) for t in types))

    def _typed(self, kind: str, schema: dict, where: str) -> str:
        if kind == "array":
            item = self.value(schema.get("items", True), f"{where}'s items")
            return f'"[" ({item} (", " {item})*)? "]"'
        if kind == "object":
            if "properties" not in schema:
                return '"{" (str ": " any (", " str ": " any)*)? "}"'
            fields = [(k, json.dumps(json.dumps(k, ensure_ascii=False) + ": "), v)
                      for k, v in schema["properties"].items()]
            return f'"{{" {self.fields(fields, schema.get("required", []), where)} "}}"'
        return {"string": "str", "integer": "int", "number": "num", "boolean": "bool", "null": "none"}[kind]

    def fields(self, fields: list[tuple[str, str, Any]], required: list[str], where: str) -> str:
        """(key, its EBNF prefix, its schema) in the given order, each optional
        one skippable, ", " between. Built from the last: `first` is the rule of
        the fields from here on with none written before, `later` with some."""
        first, later = '""', '""'
        for key, prefix, schema in reversed(fields):
            field = f"{prefix} {self.value(schema, f'{where}.{key}')}"
            optional = key not in required
            first, later = (self.rule(f"{field} {later}" + (f" | {first}" if optional else "")),
                            self.rule(f"{_SEP} {field} {later}" + (f" | {later}" if optional else "")))
        return first


def kwargs_grammar(tool: str, parameters: dict | None) -> str:
    """The EBNF (root: the arguments between the call's parentheses) of a
    tool whose parameters are this JSON schema. GrammarError if it cannot be held."""
    b = _Builder(tool)
    parameters = parameters or {"type": "object"}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise GrammarError(f"tool {tool!r}: parameters must be an object schema")
    unheld = sorted(set(parameters) - {"type", "properties", "required"} - _ANNOTATIONS)
    if unheld:
        raise GrammarError(f"tool {tool!r}: {', '.join(unheld)} of its parameters cannot be held in Python "
                           "call arguments (pythonic tool-call format)")
    properties = parameters.get("properties", {})
    for key in properties:
        if not key.isidentifier() or keyword.iskeyword(key):
            raise GrammarError(f"tool {tool!r}: parameter {key!r} cannot be a Python keyword argument")
    fields = [(k, json.dumps(f"{k}="), v) for k, v in properties.items()]
    root = b.fields(fields, parameters.get("required", []), "parameters")
    return "\n".join([f"root ::= {root}", *b.rules]) + _BASE
