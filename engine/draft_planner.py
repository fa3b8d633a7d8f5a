"""The draft a finishing request's next step verifies: what its grammar
forces first, then its session's drafter (prompt lookup or suffix), clipped
to what the grammar allows and extended by the rest of a schema name the
text has begun."""
from __future__ import annotations

import time

from agentkv.engine.request import Request
from agentkv.engine.step_observer import Observers
from agentkv.spec.drafters import Drafters
from agentkv.spec.schema_phrases import MAX_PHRASE_OVERLAP, continuations


class DraftPlanner:
    def __init__(self, drafters: Drafters, max_context: int, observers: Observers):
        self.drafters, self.max_context, self.observers = drafters, max_context, observers

    def draft(self, req: Request) -> list[int]:
        """req's draft for its next step; observed where req speculates."""
        if not req.speculative or not self.drafters.enabled:
            return []
        if not self.observers:  # timed only for someone watching: this runs every step
            return self._draft(req)
        start = time.perf_counter()
        draft = self._draft(req)
        self.observers.draft(req, draft, time.perf_counter() - start)
        return draft

    def _draft(self, req: Request) -> list[int]:
        seq = req.seq
        room = min(req.params.max_tokens - len(req.output), self.max_context - len(seq.tokens)) - 1
        if room < 1 or not req.output:
            return []
        drafter = seq.draft_index(self.drafters.new)
        # What the grammar forces next comes first; prompt lookup continues after it.
        forced = req.grammar.forced()[:room] if req.grammar is not None and self.drafters.forced else []
        req.forced = len(forced)
        k = min(drafter.draft_len, room - len(forced))
        # Which tokens a seeded sample emits depends on what was drafted
        # (a draft token is accepted with probability p, a free draw is an
        # inverse CDF): drafting from other sessions' outputs would make a
        # seeded reply depend on them, so it drafts from its own session only.
        shared = req.params.greedy or req.params.seed is None
        if forced and k > 0:
            drafter.extend(forced)
            more = drafter.propose(k, shared)
            drafter.truncate(len(seq.tokens))
        else:
            more = drafter.propose(k, shared) if k > 0 else []
        draft = forced + more
        if req.grammar is None:
            return draft
        # A draft token the grammar forbids could never be accepted, nor anything after it.
        draft = req.grammar.clip(draft) if draft else draft
        phrases = req.grammar.grammar.phrases
        if k > 0 and phrases and self.drafters.schema and len(draft) <= len(forced):
            # Nothing allowed past the forced tokens: the rest of a schema name
            # the text has begun, the one the grammar lets through furthest.
            for rest in continuations(phrases, seq.tokens[-MAX_PHRASE_OVERLAP:] + forced, k):
                allowed = req.grammar.clip(forced + rest)
                if len(allowed) > len(draft):
                    draft = allowed
        return draft
