"""How profiling and benchmarks watch the scheduler without patching it: a
StepObserver's hooks are called at each forward step, each draft planned and
each verdict applied. The scheduler calls them on its own thread, under its
lock, so they should be short and must not call back into the engine; one
that raises is logged and skipped, and never fails a request."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from agentkv.engine.step_item import StepItem

if TYPE_CHECKING:
    from agentkv.engine.request import Request

log = logging.getLogger("agentkv.scheduler")


class StepObserver:
    """Every hook does nothing here: override those you need."""

    def on_step(self, phase: str, items: list[StepItem], forward_s: float) -> None:
        """A forward ran: phase ("prefill", "decode" or "verify", named by the
        heaviest work in it), its items, and its seconds."""

    def on_draft(self, req: Request, draft: list[int], seconds: float) -> None:
        """req, which speculates, will verify draft in its next step (empty
        where there was nothing to propose), planned in seconds."""

    def on_verdict(self, req: Request, draft: list[int], accepted: int, tokens: list[int]) -> None:
        """req's step accepted the first `accepted` tokens of draft, and added
        tokens to its output: those accepted, then the one drawn, cut at a
        stop."""


class Observers:
    """The observers a scheduler has now; each hook is called on each, in the
    order they were added."""

    def __init__(self) -> None:
        self._all: tuple[StepObserver, ...] = ()

    def __bool__(self) -> bool:
        return bool(self._all)

    def add(self, observer: StepObserver) -> None:
        self._all += (observer,)

    def remove(self, observer: StepObserver) -> None:
        """ValueError if observer was never added."""
        if observer not in self._all:
            raise ValueError("that observer is not watching this scheduler")
        self._all = tuple(o for o in self._all if o is not observer)

    def step(self, phase: str, items: list[StepItem], forward_s: float) -> None:
        for o in self._all:
            _call(o.on_step, phase, items, forward_s)

    def draft(self, req: Request, draft: list[int], seconds: float) -> None:
        for o in self._all:
            _call(o.on_draft, req, draft, seconds)

    def verdict(self, req: Request, draft: list[int], accepted: int, tokens: list[int]) -> None:
        for o in self._all:
            _call(o.on_verdict, req, draft, accepted, tokens)


def _call(hook, *args) -> None:
    try:
        hook(*args)
    except Exception:  # an observer's bug is its own: the step goes on
        log.exception("a step observer failed")
