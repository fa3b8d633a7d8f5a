"""What the batch planner gives a step for one request, and the name of a
step's phase."""
from __future__ import annotations

from dataclasses import dataclass

from agentkv.engine.request import Request
from agentkv.engine.step_item import StepItem


@dataclass(slots=True, eq=False)
class Work:
    req: Request
    item: StepItem | None  # None: the request draws from logits it already has
    draft: list[int] | None  # None: a prompt chunk short of the end


def step_phase(work: list[Work]) -> str:
    """A step named by the heaviest work in it, for profilers and observers."""
    if any(w.draft is None or (w.item is not None and len(w.item.tokens) > len(w.draft) + 1) for w in work):
        return "prefill"
    return "verify" if any(w.draft for w in work) else "decode"
