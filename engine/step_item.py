"""One item of a forward step: a sequence's block table, the tokens to
append to it, and how many trailing logits to return. The runner computes
them (engine/runner.py), the decode graphs replay them (engine/decode_graphs.py),
the scheduler plans them (engine/batch_planner.py)."""
from __future__ import annotations

from dataclasses import dataclass

from agentkv.cache.block_table import BlockTable


@dataclass(slots=True)
class StepItem:
    table: BlockTable
    tokens: list[int]
    num_logits: int = 1  # logits of the last num_logits tokens are returned
