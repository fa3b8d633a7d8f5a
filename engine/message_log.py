"""A session's conversation as messages, so that its next chat turn is
matched message by message instead of by re-rendering the history.

After a chat turn the session's tokens are the rendered conversation up to
its reply, with the reply exactly as sampled. The log says which messages
those are (a digest of each, in a canonical form), with which tools, how
many tokens they span, and what the template writes after the last held
token to end the reply's message (the gap: ChatML's newline after a sampled
`<|im_end|>`, or `<|im_end|>` itself after a reply cut by max_tokens). A request whose
messages begin with exactly those is continued natively: its new messages
alone are rendered (model.chat_suffix) and tokenized, and the held tokens
are kept as they are, including a reply the tokenizer would spell
otherwise and text the template would no longer write.

The canonical form is what a client echoes back: the role, the content
(stripped; none and empty are one), the name, and tool calls by function
name and parsed arguments. Tool-call ids are not part of it: the server
made them up and the model did not say them (Mistral's templates render
them, but only into history after the reply, which the held reply, as
sampled, never includes).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

CONTINUATIONS = ("native", "template-faithful")


def _arguments(arguments: object) -> object:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _calls(message: dict) -> list:
    out = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call)
        out.append([fn.get("name"), _arguments(fn.get("arguments"))])
    return out


def digest(message: dict) -> bytes:
    # Plain fields are hashed as they are, each after its length (so no
    # field's text can pass for a boundary); only tool calls need JSON's
    # canonical form: they are what clients re-serialise (spacing, key order).
    h = hashlib.blake2b(digest_size=16)
    content = message.get("content")
    content = (content or "").strip() if content is None or isinstance(content, str) else json.dumps(
        content, sort_keys=True, ensure_ascii=False)
    for part in (message.get("role"), content, message.get("name") or ""):
        data = str(part).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    calls = _calls(message)
    if calls:
        h.update(json.dumps(calls, sort_keys=True, ensure_ascii=False).encode())
    return h.digest()


def tools_digest(tools: list[dict] | None) -> bytes:
    return hashlib.blake2b(json.dumps(tools, sort_keys=True, ensure_ascii=False).encode(), digest_size=16).digest()


@dataclass(frozen=True)
class MessageLog:
    digests: tuple[bytes, ...]  # the conversation's messages, its reply last
    tools: bytes
    length: int  # the session's tokens the messages span
    gap: str  # template text after the last held token, before the next message
    prepositioned: tuple[int, ...] = ()  # held past `length`: what the next message was expected to begin with

    def to_json(self) -> dict:
        return {"digests": [d.hex() for d in self.digests], "tools": self.tools.hex(), "length": self.length,
                "gap": self.gap, "ahead": list(self.prepositioned)}  # the key saved files have always had

    @classmethod
    def from_json(cls, body: dict) -> "MessageLog":
        """A saved log (ValueError if it is not one): a resumed session continues natively."""
        try:
            log = cls(tuple(bytes.fromhex(d) for d in body["digests"]), bytes.fromhex(body["tools"]),
                      int(body["length"]), str(body["gap"]), tuple(int(t) for t in body["ahead"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a message log: {e}") from None
        if log.length < 0 or not all(len(d) == 16 for d in log.digests):
            raise ValueError("not a message log")
        return log

    def continues(self, digests: list[bytes], tools: bytes, session_length: int) -> bool:
        """Whether a request of these messages (and tools) extends the logged
        conversation by at least one message, on a session still as logged."""
        n = len(self.digests)
        return (session_length == self.length + len(self.prepositioned) and tools == self.tools and len(digests) > n
                and tuple(digests[:n]) == self.digests)
