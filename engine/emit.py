"""The one batched pass after a forward: mask, verify and sample every row
of the step at once.

Each finishing request brings its rows (the logits after its chunk's last
token and after each draft token) and its draft. Grammar masks of all
constrained rows go into one bitmask applied once; greedy requests are
verified in one verify_drafts call and sampling requests in another (their
probabilities made per request, since each has its own temperature and
filters); the results cross to the host in one transfer per call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import xgrammar as xgr

from agentkv.kernels import dispatch
from agentkv.engine.request import Request
from agentkv.model.sampler import draw_uniforms, probs_from_logits


@dataclass(slots=True)
class Verdict:
    accepted: int  # draft tokens accepted
    token: int  # the token drawn after them


def _masked(rows: list[torch.Tensor], reqs: list[Request], drafts: list[list[int]],
            errors: list[BaseException | None]) -> list[torch.Tensor]:
    """rows with each constrained request's grammar mask applied, all in one
    pass; a grammar that fails marks its request's error instead."""
    constrained = []
    for i, r in enumerate(reqs):
        if r.grammar is not None:
            constrained.append(i)
    if not constrained:
        return rows
    vocab = rows[constrained[0]].shape[-1]
    bitmask = xgr.allocate_token_bitmask(sum(len(drafts[i]) + 1 for i in constrained), vocab)
    ok, offset = [], 0
    for i in constrained:
        try:
            reqs[i].grammar.fill_bitmask(bitmask, offset, drafts[i])
            ok.append(i)
        except Exception as e:
            errors[i] = e
        offset += len(drafts[i]) + 1
    out = list(rows)
    if ok:
        # A copy: the rows may be a session's held logits.
        joined = torch.cat([rows[i].float() for i in constrained])
        xgr.apply_token_bitmask_inplace(joined, bitmask.to(joined.device))
        for i, part in zip(constrained, joined.split([len(drafts[i]) + 1 for i in constrained])):
            out[i] = part
    return out


def _width(drafts: list[list[int]]) -> int:
    return max(1, max(map(len, drafts)))


def _verify(target: list[torch.Tensor], drafts: list[list[int]], uniforms: torch.Tensor | None) -> list[Verdict]:
    if uniforms is None and not any(drafts):
        # Greedy rows without a draft (plain decodes): verify_drafts would
        # take each row's argmax, ties to the lowest index as torch.argmax
        # does; one op and one transfer instead of its metadata (about 15
        # ops a step).
        rows = target[0] if len(target) == 1 else torch.cat(target)
        return [Verdict(0, t) for t in rows.argmax(-1).tolist()]
    device = target[0].device
    width = _width(drafts)
    padded = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.int64, device=device)
    lens = torch.tensor([len(d) for d in drafts], dtype=torch.int32, device=device)
    cu = torch.zeros(len(drafts) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(lens + 1, 0)
    accepted, token = dispatch.verify_drafts(torch.cat(target), cu, padded, lens, uniforms)
    both = torch.cat([accepted.to(torch.int64), token]).tolist()  # the one host transfer
    n = len(drafts)
    return [Verdict(a, t) for a, t in zip(both[:n], both[n:])]


def verdicts(reqs: list[Request], rows: list[torch.Tensor], drafts: list[list[int]]) -> list[Verdict | BaseException]:
    """For each request, how much of its draft the target accepts and the
    token it draws next (grammar masks applied first), or the error that
    request alone ran into (its grammar, its sampling parameters)."""
    out: list[Verdict | BaseException | None] = [None] * len(reqs)
    rows = _masked(rows, reqs, drafts, out)
    greedy = [i for i, r in enumerate(reqs) if out[i] is None and r.params.greedy]
    if greedy:
        for i, v in zip(greedy, _verify([rows[i] for i in greedy], [drafts[i] for i in greedy], None)):
            out[i] = v
    probs = {}
    for i, r in enumerate(reqs):
        if out[i] is None:
            try:
                probs[i] = probs_from_logits(rows[i], r.params)
            except Exception as e:
                out[i] = e
    if probs:
        sampled = list(probs)
        width = 1 + _width([drafts[i] for i in sampled])
        # Each row's uniforms come from its own generator, so a seeded request
        # draws the same whatever shares its step.
        u = torch.stack([
            torch.cat([draw_uniforms([reqs[i].generator] * (len(drafts[i]) + 1), len(drafts[i]) + 1),
                       torch.zeros(width - len(drafts[i]) - 1)])
            for i in sampled
        ]).to(probs[sampled[0]].device)
        for i, v in zip(sampled, _verify(list(probs.values()), [drafts[i] for i in sampled], u)):
            out[i] = v
    return out  # type: ignore[return-value]
