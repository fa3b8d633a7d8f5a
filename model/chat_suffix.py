"""Rendering the tail of a conversation without rendering its history.

A chat template renders a whole conversation, but what it writes for the
newest messages depends on little of what came before: the conversation's
head (the system message, and the first user message, which some templates
single out, e.g. to put the tools in it) and the message just before (whose
role decides, e.g., whether a tool result opens a new user turn). So the
text that rendering `messages` adds after `messages[:k]` is the text that
rendering `anchor + messages[k:]` adds after `anchor`, where the anchor is
that head and `messages[k - 1]`: a render whose cost does not grow with the
history. tests/test_chat_suffix.py holds every template the project ships
or tests to it over generated conversations; a template that looks ahead
(renders a message differently once another follows it) shows as an anchor
whose render is not a prefix of the longer one, and gets None.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from agentkv.model.tokenizer import TokenizerError

if TYPE_CHECKING:
    from agentkv.model.tokenizer import Tokenizer


def anchor(messages: list[dict], k: int) -> list[dict]:
    """What the messages after messages[:k] are rendered behind (k >= 1)."""
    first = next((i for i, m in enumerate(messages[:k]) if m.get("role") != "system"), k - 1)
    return messages[:k] if k - 1 <= first + 1 else messages[: first + 1] + [messages[k - 1]]


def _render(tokenizer: "Tokenizer", messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                         tokenize=False)


def render_suffix(tokenizer: "Tokenizer", messages: list[dict], k: int, tools: list[dict] | None) -> str | None:
    """The text the render of `messages` (with the generation prompt) has
    after the render of `messages[:k]` (without), rendered from the anchor
    only; None if the template does not allow it (or refuses the anchor
    alone, as Llama 3.1's does a system message without a user message)."""
    a = anchor(messages, k)
    try:
        before = _render(tokenizer, a, tools, False)
        after = _render(tokenizer, a + messages[k:], tools, True)
    except TokenizerError:
        return None
    return after[len(before):] if after.startswith(before) else None


def reply_gap(tokenizer: "Tokenizer", messages: list[dict], reply: dict, tools: list[dict] | None,
              said: str, end_text: str | None) -> str | None:
    """What the template writes, rendering `reply` as history after
    `messages`, past what the model said (`said`: the reply's tokens decoded,
    special tokens included). Where the template writes the reply as said,
    that is the rest of its message: ChatML's newline after a sampled
    `<|im_end|>`, or `<|im_end|>` and the newline after a reply cut by
    max_tokens. Where it writes the reply otherwise (re-serialised tool
    calls), it is what follows the last end_text, the end-of-turn token the
    reply ended on. None if neither applies."""
    a = anchor(messages, len(messages))
    try:
        prompt = _render(tokenizer, a, tools, True)
        rendered = _render(tokenizer, a + [reply], tools, False)
    except TokenizerError:
        return None
    if not rendered.startswith(prompt):
        return None
    body = rendered[len(prompt):]
    if body.startswith(said):
        return body[len(said):]
    at = body.rfind(end_text) if end_text and said.endswith(end_text) else -1
    return body[at + len(end_text):] if at >= 0 else None


def tool_result_opening(tokenizer: "Tokenizer", messages: list[dict], tools: list[dict] | None) -> str:
    """What the template writes, after `messages`, before a tool result's
    content whatever it says (ChatML: `<|im_start|>user` and the tool
    response's opening tag): the common part of two probes' renders, cut
    after its last added token, so that it tokenizes alone as it would in
    the whole. Empty if there is none."""
    probes = [render_suffix(tokenizer, messages + [{"role": "tool", "tool_call_id": "probe", "content": c}],
                            len(messages), tools) for c in ("\x01", "\x02")]
    if None in probes:
        return ""
    common = os.path.commonprefix(probes)
    ends = [common.rfind(t) + len(t) for t in tokenizer.added_tokens.values() if t and t in common]
    return common[: max(ends, default=0)]
