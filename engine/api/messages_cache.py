"""A Messages API request's cache_control breakpoints, kept once its turn
has ended, and the cache counts of its usage, from the engine's own.

A breakpoint's prefix is the rendering of the chat messages up to its
marked block, as far as the turn's session holds the same tokens (what the
template writes after the marked block, and any reply held as sampled
rather than as the template would spell it, is not part of it). Each is
kept by the tenant's CachePins for its TTL.

Usage splits the prompt three ways, as Anthropic's does:
cache_read_input_tokens are the prompt's tokens whose KV the turn found
held (its session's, the prefix cache's or the second tier's, marked or
not); cache_creation_input_tokens those it computed that lie under a
breakpoint (in cache_creation, by the TTL of the shortest breakpoint that
covers them); input_tokens the rest.
"""
from __future__ import annotations

from agentkv.engine import Session, Tokenizer, TurnResult, common_prefix_len
from agentkv.engine.api.cache_pins import CachePins
from agentkv.engine.api.messages_prompt import Breakpoint
from agentkv.engine.api.messages_schemas import TTL_SECONDS, CacheCreation, MessagesUsage

_TTL_NAMES = {seconds: name for name, seconds in TTL_SECONDS.items()}


class MarkedPrefixes:
    def __init__(self, pins: CachePins, tenant: str, tokenizer: Tokenizer, breakpoints: list[Breakpoint],
                 tools: list[dict] | None):
        self.pins, self.tenant, self.tokenizer = pins, tenant, tokenizer
        self.breakpoints, self.tools = breakpoints, tools
        self.kept: list[tuple[int, float]] = []  # (prefix length, seconds), as the turn's session held them

    def keep(self, session: Session, result: TurnResult) -> None:
        """ChatTurn's keep: pin each breakpoint's prefix of the session holding the finished turn."""
        prompt = session.tokens[: result.usage["prompt_tokens"]]
        for bp in self.breakpoints:
            ids = self.tokenizer.apply_chat_template(bp.messages, tools=self.tools, add_generation_prompt=False)
            length = common_prefix_len(prompt, ids)
            if length:
                self.pins.hold(self.tenant, session, length, bp.seconds)
                self.kept.append((length, bp.seconds))

    def usage(self, result: TurnResult) -> MessagesUsage:
        u = result.usage
        read = u["cached_tokens"]
        written = {"5m": 0, "1h": 0}
        covered = read  # tokens already counted
        for length, seconds in sorted(self.kept):
            written[_TTL_NAMES[seconds]] += max(0, length - covered)
            covered = max(covered, length)
        creation = sum(written.values())
        return MessagesUsage(
            input_tokens=u["prompt_tokens"] - read - creation, output_tokens=u["completion_tokens"],
            cache_read_input_tokens=read, cache_creation_input_tokens=creation,
            cache_creation=CacheCreation(ephemeral_5m_input_tokens=written["5m"], ephemeral_1h_input_tokens=written["1h"]),
        )
