"""The text a stored response's session spells: the pieces its turns added,
each turn's piece linked to the one before, so that a conversation of n turns
keeps its text once rather than n times."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HeldText:
    parent: "HeldText | None"
    piece: str
    end: int = field(init=False)  # the length of the whole text

    def __post_init__(self) -> None:
        object.__setattr__(self, "end", (self.parent.end if self.parent else 0) + len(self.piece))

    def text(self) -> str:
        pieces, node = [], self
        while node is not None:
            pieces.append(node.piece)
            node = node.parent
        return "".join(reversed(pieces))

    def is_prefix_of(self, text: str) -> bool:
        if len(text) < self.end:
            return False
        node: HeldText | None = self
        while node is not None:
            if not text.startswith(node.piece, node.end - len(node.piece)):
                return False
            node = node.parent
        return True
