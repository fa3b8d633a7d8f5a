"""Schema-aware drafts: inside a tool call, what the model writes next is
often a name from the called tool's JSON schema (a property, an enum value)
that the grammar allows but does not force, because several are possible.

The phrases are those names as the model spells them in a call (` "limit":`,
` "fast`); a draft is the rest of a phrase whose beginning the text already
ends with. Which phrases the grammar allows is the grammar's to say: the
scheduler keeps the candidate it lets through furthest. Only a proposal:
verification keeps the output what it would have been.
"""
from __future__ import annotations

from typing import Callable, Iterable

# How many of the history's last tokens a phrase's beginning is matched against.
MAX_PHRASE_OVERLAP = 8


def schema_phrases(tools: Iterable[dict], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """Token spellings of the tools' names, property names and string enum
    values (OpenAI tool shapes), as they appear inside a Hermes-style call."""
    texts: dict[str, None] = {}
    for tool in tools:
        fn = tool.get("function", tool)
        if isinstance(fn.get("name"), str):
            texts[f' "{fn["name"]}",'] = None
        _schema_texts(fn.get("parameters") or {}, texts)
    return tuple(tuple(encode(t)) for t in texts)


def _schema_texts(schema: dict, texts: dict[str, None]) -> None:
    if not isinstance(schema, dict):
        return
    for name, sub in (schema.get("properties") or {}).items():
        texts[f' "{name}":'] = None
        texts[f' {{"{name}":'] = None  # the first property, opening the object
        _schema_texts(sub, texts)
    for value in schema.get("enum") or ():
        if isinstance(value, str):
            texts[f' "{value}'] = None
    if isinstance(schema.get("items"), dict):
        _schema_texts(schema["items"], texts)


def continuations(phrases: tuple[tuple[int, ...], ...], tokens: list[int], limit: int) -> list[list[int]]:
    """The rest of each phrase whose first i >= 1 tokens the history ends
    with, longest overlap first, at most limit tokens each, no repeats."""
    found: dict[tuple[int, ...], int] = {}
    for phrase in phrases:
        for i in range(min(len(phrase) - 1, len(tokens)), 0, -1):
            if tuple(tokens[len(tokens) - i :]) == phrase[:i]:
                rest = phrase[i : i + limit]
                found[rest] = max(found.get(rest, 0), i)
                break
    return [list(r) for r in sorted(found, key=lambda r: -found[r])]
