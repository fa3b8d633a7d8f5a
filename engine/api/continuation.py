"""One Responses API turn on the engine.

The request's items become chat messages after the conversation so far (the
previous responses' input and replies, as chat completions would be sent it),
and the whole conversation is rendered with the chat template. The previous
response's session already holds the KV of a prefix of that text: the text
its tokens spell (its prompt, then the reply as generated, ending at EOS, say
`<|im_end|>`, where the template also writes a newline). Only the rest, the
new turn's text, is tokenized and appended to a fork of that session; the
history is neither re-tokenized nor recomputed.

The rest is cut off the rendered text only where tokenizing it alone gives
the tokens tokenizing the whole would: at an added token (`<|im_end|>`,
`<|im_start|>`, ...), which the tokenizer splits on before anything else.
When the session's text is not a prefix of the rendering (other
instructions or tools, a reply the template writes differently, a cut inside
a character), the turn starts from a new session with the whole rendering,
and the prefix cache finds what it can: slower, never wrong.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.api.held_text import HeldText
from engine.api.response_items import Item, call_ids, system_message, to_messages
from engine.api.response_store import StoredResponse
from engine.engine import common_prefix_len

if TYPE_CHECKING:
    from engine import Session
    from model.tokenizer import Tokenizer


@dataclass(frozen=True)
class Plan:
    base: StoredResponse | None  # whose session to fork; None: a new session
    held: HeldText | None  # what that session's tokens spell
    delta_text: str
    delta_ids: list[int]
    messages: list[dict]  # the request's items as chat messages

    @property
    def prompt_len(self) -> int:
        return (len(self.base.session) if self.base else 0) + len(self.delta_ids)


def plan(
    tokenizer: "Tokenizer", previous: StoredResponse | None, items: list[Item], instructions: str | None,
    tools: list[dict] | None, max_prompt: int | None = None,
) -> Plan:
    """What a turn appends (its items, rendered after the conversation so far) and to which session.
    With max_prompt (truncation "auto"), a longer prompt drops the conversation's oldest messages
    until it fits, and starts a new session; if even the newest alone does not, it is left whole
    (for the budget check to refuse)."""
    history = previous.conversation() if previous else []
    messages = to_messages(items, call_ids(history))
    system = [system_message(instructions)] if instructions else []
    text = tokenizer.apply_chat_template(system + history + messages, tools=tools, tokenize=False)
    base = previous if previous is not None and _continues(tokenizer, previous.held, text) else None
    held = base.held if base else None
    delta = text[held.end :] if held else text
    whole = Plan(base, held, delta, tokenizer.encode(delta), messages)
    if max_prompt is None or whole.prompt_len <= max_prompt:
        return whole
    conversation = history + messages
    for start in range(1, len(conversation)):
        text = tokenizer.apply_chat_template(system + conversation[start:], tools=tools, tokenize=False)
        ids = tokenizer.encode(text)
        if len(ids) <= max_prompt:
            return Plan(None, None, text, ids, messages)
    return whole


def _added_tokens(tokenizer: "Tokenizer") -> dict[int, str]:
    return {i: token.content for i, token in tokenizer.backend.get_added_tokens_decoder().items()}


def _continues(tokenizer: "Tokenizer", held: HeldText, text: str) -> bool:
    if not held.is_prefix_of(text):
        return False
    rest = text[held.end :]
    return any(held.piece.endswith(a) or rest.startswith(a) for a in _added_tokens(tokenizer).values())


def retokenize_reply(tokenizer: "Tokenizer", session: "Session", prompt_len: int) -> None:
    """Hold the reply as the rendered conversation tokenizes it. The model may
    spell its text in tokens the tokenizer would not choose (a grammar that
    masks token by token often makes it): kept, the next turn's prompt would
    differ from the whole conversation's. From the first such token on, the
    tail is replaced by the tokenizer's (made pending: the next turn computes
    it with its own tokens, as chat completions recompute from a difference).
    The tail starts after the last added token before the reply, where the
    tokenizer splits anyway."""
    tokens, added = session.tokens, _added_tokens(tokenizer)
    start = next((i + 1 for i in range(prompt_len - 1, -1, -1) if tokens[i] in added), 0)
    drawn = tokens[start:]
    canonical = tokenizer.encode(tokenizer.decode(drawn))
    if canonical != drawn:
        same = common_prefix_len(drawn, canonical)
        session.truncate(start + same)
        if canonical[same:]:
            session.queue(canonical[same:])
