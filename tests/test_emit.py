"""engine.emit's greedy rows without drafts take a shortcut past
verify_drafts: the token it picks must be the one verify_drafts and
torch.argmax pick, ties and NaNs included."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from agentkv.engine.emit import verdicts


def _greedy() -> SimpleNamespace:
    return SimpleNamespace(grammar=None, params=SimpleNamespace(greedy=True))


def test_plain_greedy_rows_pick_what_verify_drafts_and_torch_argmax_pick():
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(1, 97, generator=gen) for _ in range(6)]
    rows[1][0, [5, 40, 90]] = 9.0  # a tie: the first
    rows[2][0, [7, 60]] = float("nan")  # a NaN over any number: the first NaN
    rows[3][0] = float("-inf")  # nothing but -inf: index 0
    rows[4][0, 96] = float("inf")
    rows[5] = rows[5].round(decimals=0)  # many ties
    want = torch.cat(rows).argmax(-1).tolist()
    reqs = [_greedy() for _ in rows]
    shortcut = verdicts(reqs, rows, [[] for _ in rows])  # one call for all rows
    alone = [verdicts([r], [row], [[]])[0] for r, row in zip(reqs, rows)]  # one row block each
    # With a draft the full verify runs: a rejected first draft token gives the target's own pick.
    drafted = [verdicts([r], [torch.cat([row, row])], [[(t + 1) % 97]])[0] for r, row, t in zip(reqs, rows, want)]
    assert [v.token for v in shortcut] == want
    assert [v.token for v in alone] == want
    assert [(v.accepted, v.token) for v in drafted] == [(0, t) for t in want]
    assert all(v.accepted == 0 for v in shortcut + alone)
