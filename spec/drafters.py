"""Which drafter an engine's sessions get, and what drafters of one namespace share.

- "ngram": prompt lookup over the session's own history (spec.ngram), the baseline;
- "suffix": suffix trees over the session's history and over the recent
  outputs of every session in its namespace (spec.suffix);
- "none": no speculation: every step decodes one token per request, as a
  server without a speculative config does (the fair baseline against one).
"""
from __future__ import annotations

from typing import Callable

from agentkv.spec.drafter import Drafter
from agentkv.spec.ngram import NGramDrafter
from agentkv.spec.suffix import MAX_SESSION_NODES, NodeBudget, OutputTrees, SuffixDrafter

DRAFTING = ("ngram", "suffix")
KINDS = DRAFTING + ("none",)


class Drafters:
    """forced: what a request's grammar forces next is drafted ahead of the
    drafter's own proposal; schema: where the drafter has nothing the grammar
    allows, the called tool's schema names are tried (spec.schema_phrases;
    off by default: on the agent model it gained nothing, docs/bench_spec.md).
    forced is off only to measure what it is worth."""

    def __init__(self, kind: str = "suffix", forced: bool = True, schema: bool = False,
                 max_output_tokens: int = 1 << 15, max_namespaces: int = 16, max_session_nodes: int = MAX_SESSION_NODES,
                 owner: Callable[[str], str] = lambda namespace: ""):
        if kind not in KINDS:
            raise ValueError(f"drafter must be one of {KINDS}, got {kind!r}")
        self.kind, self.forced, self.schema = kind, forced, schema
        self.enabled = kind != "none"
        # owner: whose namespace it is (the engine's tenants): max_namespaces is per owner.
        self.outputs = OutputTrees(max_output_tokens, max_namespaces, owner=owner) if kind == "suffix" else None
        # One bound over every session's tree, whatever the number of sessions.
        self.session_nodes = NodeBudget(max_session_nodes) if kind == "suffix" else None

    def new(self, namespace: str) -> Drafter:
        """A drafter for a sequence in namespace (its history empty)."""
        if self.outputs is None:
            return NGramDrafter()
        return SuffixDrafter(self.outputs.get(namespace), budget=self.session_nodes)

    def finished(self, namespace: str, output: list[int]) -> None:
        """A generation in namespace ended with these tokens: later drafts there may copy them."""
        if self.outputs is not None:
            self.outputs.get(namespace).add(output)
