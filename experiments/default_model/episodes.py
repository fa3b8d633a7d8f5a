"""Every kind of short episode the agent model trains on and is evaluated on
(experiments/default_model/tasks.py's record tools, function_tasks.py's
general functions), with each kind's share of the training episodes."""
from __future__ import annotations

import random

from agentkv.experiments.default_model import function_tasks as F
from agentkv.experiments.default_model.tasks import (
    PLACEMENTS, Episode, answer_episode, call_episode, handoff_episode, no_tool_episode, parallel_episode,
    plain_episode, task_arg_names, unfit_episode,
)

# Kind -> (maker, share of training episodes)
# Run 4 moved shares from record-tool calls (learned by then) to requests no
# general function fits: run 3 declined none of those (0% held out, BFCL's
# irrelevance 15%).
MAKERS = {"call": (call_episode, 0.16), "answer": (answer_episode, 0.12), "no_tool": (no_tool_episode, 0.06),
          "unfit": (unfit_episode, 0.09), "plain": (plain_episode, 0.08), "handoff": (handoff_episode, 0.07),
          "parallel": (parallel_episode, 0.06), "function": (F.function_episode, 0.16),
          "function_parallel": (F.function_parallel_episode, 0.06), "function_unfit": (F.function_unfit_episode, 0.14)}
KINDS = tuple(MAKERS)


def training_episode(r: random.Random, arg_ok) -> Episode:
    kinds = list(MAKERS)
    kind = r.choices(kinds, weights=[MAKERS[k][1] for k in kinds])[0]
    return MAKERS[kind][0](r, arg_ok, frozenset())


def eval_episodes(seed: int, counts: dict[str, int], arg_ok_train, heldout: frozenset[str]) -> list[Episode]:
    """Held-out episodes: calls use held-out argument names where a tool can
    (every name allowed), the general-function kinds held-out functions,
    answers and plain ones are fresh draws."""
    r = random.Random(seed)
    out = []
    for kind, n in counts.items():
        for k in range(n):
            if kind == "call":
                # Even turns: argument names from the held-out ones where a tool has them.
                ok = (lambda a: a in heldout or a not in task_arg_names()) if k % 2 == 0 else arg_ok_train
                placement = PLACEMENTS[k % len(PLACEMENTS)]
                # The value far back: always for values from earlier turns and results, else every third turn.
                far = placement in ("earlier", "result") or k % 3 == 0
                ep = call_episode(r, ok, heldout, placement=placement, filler=r.randint(2, 8) if far else 0)
            elif kind == "handoff":  # alternately the transfer and the receiving agent's call
                ep = handoff_episode(r, lambda a: True, heldout, receiving=k % 2 == 1)
            elif kind.startswith("function"):
                ep = MAKERS[kind][0](r, lambda a: True, heldout, eval_set=True)
            else:
                ep = MAKERS[kind][0](r, lambda a: True, heldout)
            out.append(ep)
    return out
