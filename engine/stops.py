"""Stop strings, as OpenAI defines them: a reply ends where the earliest of
its stop strings begins, and the stop string is not part of it. The
scheduler asks this to end a generation, the replies to cut their text, so
the two agree on where a reply ends."""
from __future__ import annotations

from typing import Iterable


def first_stop(text: str, stops: Iterable[str], start: int = 0) -> int | None:
    """Where the earliest of the stops begins in text (searched from start on); None if none occurs."""
    return min((i for s in stops if (i := text.find(s, start)) >= 0), default=None)


def cut_at_stop(text: str, stops: Iterable[str]) -> tuple[str, bool]:
    """The text before the earliest stop, and whether one occurred."""
    at = first_stop(text, stops)
    return (text, False) if at is None else (text[:at], True)
