"""What a request's tool_choice and response_format allow the model to write,
as an xgrammar structural tag in the chat template's own tool-call syntax.

- tool_choice "required" or a named function: one or more calls (exactly one
  for a named function or with parallel_tool_calls off), nothing else, then
  the end of the reply.
- "auto" with tools: free text, but once the model opens a call marker the
  call must be well formed, to a tool offered, with arguments to its schema.
- response_format json_object / json_schema: the reply is that JSON. A
  required or named tool choice takes precedence over it; under "auto" it
  replaces the marker trigger (the reply is JSON, not a call).

Arguments are JSON with at most one whitespace character between tokens
(enough for `json.dumps` layout, which the templates render), so a model
cannot spend its budget on layout, and properties in the schema's order
(the order the prompt lists them in). A tool without parameters takes any
JSON object. Formats whose calls are Python (pythonic) hold their keyword
arguments to the schema with an EBNF grammar (engine.python_args), which
refuses, as a GrammarError, the schema keywords it cannot hold.
"""
from __future__ import annotations

import re
from typing import Any, Protocol

from agentkv.engine.grammar import Grammar, GrammarCache, GrammarError
from agentkv.engine.python_args import kwargs_grammar
from agentkv.model.tokenizer import Tokenizer
from agentkv.model.tool_calls import TOOL_CALL_FORMATS, ToolCallFormat, chosen_tool_name, tool_choice_error
from agentkv.spec.schema_phrases import schema_phrases

__all__ = ["structural_tag", "request_grammar"]
_MAX_WHITESPACE = 1


class GrammarSource(Protocol):
    """What request_grammar needs of an engine."""

    tokenizer: Tokenizer
    constrain_auto: bool  # whether tool_choice "auto" holds a call to the schemas

    @property
    def grammars(self) -> GrammarCache: ...


def _function(tool: Any) -> dict:
    # Chat Completions nests the function ({"type": "function", "function": {...}});
    # the Responses API puts its fields on the tool itself.
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise GrammarError(f"a tool must be a function with a name, got {tool!r}")
    if not isinstance(fn.get("parameters", {}) or {}, dict):
        raise GrammarError(f"the parameters of tool {fn['name']!r} must be a JSON schema object")
    return fn


def _json(schema: dict | bool) -> dict:
    # Properties in the schema's order: xgrammar's any_order (0.2.9) stops
    # enforcing "required".
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": _MAX_WHITESPACE}


def _arguments(fn: dict, fmt: ToolCallFormat) -> dict:
    if fmt.python_arguments:
        return {"type": "grammar", "grammar": kwargs_grammar(fn["name"], fn.get("parameters"))}
    return _json(fn.get("parameters") or {"type": "object"})


def _call_tags(functions: list[dict], fmt: ToolCallFormat) -> list[dict]:
    return [{"type": "tag", "begin": fmt.begin(fn["name"]), "content": _arguments(fn, fmt), "end": fmt.call_end}
            for fn in functions]


def _calls(functions: list[dict], fmt: ToolCallFormat, single: bool) -> dict:
    return {"type": "tags_with_separator", "tags": _call_tags(functions, fmt), "separator": fmt.separator,
            "at_least_one": True, "stop_after_first": single}


def _forced(functions: list[dict], fmt: ToolCallFormat, single: bool) -> dict:
    """One or more calls, nothing else (in the format's list, where it has one)."""
    calls = _calls(functions, fmt, single)
    if not fmt.list_open:
        return calls
    return {"type": "sequence", "elements": [{"type": "const_string", "value": fmt.list_open}, calls,
                                             {"type": "const_string", "value": fmt.list_close}]}


def _auto(functions: list[dict], fmt: ToolCallFormat, single: bool) -> dict:
    """Free text, but what opens a call is held to well-formed calls."""
    if not fmt.marker:
        # Calls only as the whole reply (pythonic): the call list, or text that does not open one, or nothing.
        text = {"type": "sequence", "elements": [{"type": "regex", "pattern": f"[^{re.escape(fmt.unmarked)}]"},
                                                 {"type": "any_text"}]}
        return {"type": "or", "elements": [_forced(functions, fmt, single), text, {"type": "const_string", "value": ""}]}
    if fmt.list_open:
        # Free text until the list opens; the reply ends with the list.
        calls = {"type": "tag", "begin": fmt.list_open, "content": _calls(functions, fmt, single), "end": fmt.list_close}
        return {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": [calls], "stop_after_first": True}
    return {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": _call_tags(functions, fmt),
            "stop_after_first": single}


def _chosen(functions: list[dict], tool_choice: Any) -> tuple[list[dict], bool]:
    """The functions the reply may call, and whether it must call one."""
    if (why := tool_choice_error(tool_choice, [fn["name"] for fn in functions])) is not None:
        raise GrammarError(why)
    if tool_choice in (None, "auto", "none"):
        return ([] if tool_choice == "none" else functions), False
    if tool_choice == "required":
        return functions, True
    return [fn for fn in functions if fn["name"] == chosen_tool_name(tool_choice)], True


def _response_schema(response_format: Any) -> dict | bool | None:
    """The JSON schema of a response_format (chat: {"type": "json_schema",
    "json_schema": {"schema": ...}}; Responses text.format: "schema" on the
    format itself); None for plain text."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if response_format is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema", response_format)
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("response_format json_schema needs a JSON schema object under 'schema'")
        return schema
    raise GrammarError(f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}')


def structural_tag(
    tools: list[dict] | None,
    tool_choice: Any = None,
    response_format: Any = None,
    fmt: ToolCallFormat = TOOL_CALL_FORMATS["hermes"],
    parallel_tool_calls: bool = True,
) -> dict | None:
    """The xgrammar structural tag for these request options, or None when
    they leave the reply free. Raises GrammarError on options that name no
    offered tool or are malformed (schemas are checked when compiled)."""
    functions = [_function(tool) for tool in tools or ()]
    chosen, forced = _chosen(functions, tool_choice)
    schema = _response_schema(response_format)
    if forced:
        body = _forced(chosen, fmt, single=not parallel_tool_calls or tool_choice != "required")
    elif schema is not None:
        body = _json(schema)
    elif chosen:
        body = _auto(chosen, fmt, single=not parallel_tool_calls)
    else:
        return None
    return {"type": "structural_tag", "format": body}


def request_grammar(
    engine: GrammarSource,
    tools: list[dict] | None = None,
    tool_choice: Any = None,
    response_format: Any = None,
    parallel_tool_calls: bool = True,
    owner: str = "default",
) -> Grammar | None:
    """The compiled grammar (cached per engine) that constrains a reply to
    these OpenAI-style options, or None when nothing constrains it. Pass the
    result to Session.generate(grammar=...). GrammarError (a 400) on bad
    options or schemas; nothing is changed then. With engine.constrain_auto
    off, tool_choice "auto" (or none given) constrains nothing. owner: whose
    cache it is compiled in (a tenant: engine.sequence.owner_of its namespace)."""
    tag = structural_tag(tools, tool_choice, response_format, engine.tokenizer.tool_call_format,
                         parallel_tool_calls)
    if tag is None or (not engine.constrain_auto and tool_choice in (None, "auto") and response_format is None):
        return None
    grammar = engine.grammars.get(tag, owner)
    if tools and not grammar.phrases:  # once per compiled grammar: it is cached with it
        grammar.phrases = schema_phrases(tools, engine.tokenizer.encode)
    return grammar
