"""Where a sequence's KV comes from and what gives way under memory pressure.

A sequence holding no KV (new, evicted or preempted) starts from the longest
prefix of its tokens the radix cache holds, then restores from the second
tier (cache.kv_tier) what that tier holds beyond it; only the rest is
computed. When a step needs pages, what nobody uses goes first: cached
prefixes no sequence holds (least recently used first), then idle sessions
past their pin, in the retention policy's order (engine.retention). Such a
session leaves the pool through evict: its KV goes to the tier (when there
is one) and is published to the prefix cache, so a later turn finds it in
one or the other. The cached prefixes that requests waiting for their
program's admission will reuse go after those sessions: they are due back,
and losing them made a waiting agent recompute its whole history once
admitted. Next idle sessions still inside their pin give way (soft
pins), the least valuable first: the seconds bringing its KV back would
cost (restored from the tier, or recomputed), per second until its next
turn is expected, save that a tenant's pins beyond its share of the pool
go before any other's. Only then does the scheduler preempt running work: idle
KV is never kept at the price of work in flight (Continuum pins only while
that starves nothing). A sequence pinned for good (pin_ttl None) never
gives way.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from typing import Iterable

from agentkv.cache.block_table import BlockTable
from agentkv.cache.kv_tier import KVTier
from agentkv.cache.pool import PagePool
from agentkv.cache.radix import RadixCache
from agentkv.engine.retention import Retention
from agentkv.engine.sequence import Sequence, owner_of

# A pinned session already due back is worth holding as if it were due in this long.
MIN_WAIT_S = 0.05


class KVPolicy:
    def __init__(self, pool: PagePool, radix: RadixCache | None, prefix_match: str = "token",
                 retention: Retention | None = None, tier: KVTier | None = None):
        # "block" reuses whole pages only, as block-hash caches (vLLM) and
        # page-aligned radix trees do: the baseline token granularity beats.
        if prefix_match not in ("token", "block"):
            raise ValueError(f"prefix_match must be 'token' or 'block', not {prefix_match!r}")
        self.pool, self.radix, self.prefix_match = pool, radix, prefix_match
        self.retention = retention or Retention()
        self.tier = tier
        # Seconds a prefill token costs, measured by the scheduler: whether a
        # preempted sequence's KV is cheaper copied out and back or recomputed.
        self.prefill_s_per_token: float | None = None

    def publish(self, seq: Sequence) -> None:
        """Offer the sequence's computed tokens to the prefix cache."""
        n = self.radix is not None and seq.table.length
        if n:
            self.radix.insert(seq.tokens[:n], seq.table.pages[: -(-n // self.pool.page_size)], seq.namespace)

    def release(self, seq: Sequence) -> None:
        """Publish, then drop every page of the sequence; its tokens stay."""
        self.publish(seq)
        seq.table.release()
        seq.last_logits = None

    def evict(self, seq: Sequence, preempted: bool = False, family_busy: bool = False) -> None:
        """Move the sequence out of the pool: its KV to the tier (for a
        preempted one, only when copying beats recomputing), then release.
        family_busy: a fork of the same session is working its turn; the
        tier's entry is that fork's to keep (this one's tokens are older)."""
        if self.tier is not None and seq.table.length and (not preempted or self._copy_beats_recompute(seq.table.length)):
            self.tier.offload(seq.key, seq.namespace, seq.tokens, seq.table, replace=not family_busy)
        self.release(seq)

    def bring_back_s(self, seq: Sequence) -> float:
        """What the sequence's KV in the pool would cost to have again once it
        leaves: restored from the tier where it would go there, else
        recomputed (in tokens, while nothing is measured)."""
        tokens = seq.table.length
        c = self.tier.counters if self.tier is not None else None
        if c is not None and c.restore_bytes and self.tier.host_bytes:
            return tokens * self.tier.token_bytes * c.restore_s / c.restore_bytes
        return tokens * (self.prefill_s_per_token or 1.0)

    def _copy_beats_recompute(self, tokens: int) -> bool:
        c = self.tier.counters
        if self.prefill_s_per_token is None or not c.offload_bytes or not c.restore_bytes:
            return True  # nothing measured yet: a copy is the better bet on any device
        copy_s = tokens * self.tier.token_bytes * (c.offload_s / c.offload_bytes + c.restore_s / c.restore_bytes)
        return copy_s < tokens * self.prefill_s_per_token

    def persist(self, seq: Sequence) -> bool:
        """Write seq's KV through to the tier's disk (kept across restarts)."""
        tier = self.tier
        if tier is None or tier.disk is None:
            return False
        if seq.table.length and not tier.offload(seq.key, seq.namespace, seq.tokens, seq.table):
            return False
        return tier.persist(seq.key)

    def forget(self, seq: Sequence, family_alive: bool) -> None:
        """seq is closed: its tier entry goes unless another of its family lives or it is persistent."""
        if self.tier is not None and not family_alive:
            self.tier.drop(seq.key)

    def reuse_prefix(self, seq: Sequence, limit: int) -> int:
        """A sequence holding no KV starts from the longest cached prefix of
        its tokens (at most limit of them). Returns the tokens matched."""
        if self.radix is None or seq.table.length or not seq.tokens or limit < 1:
            return 0
        length, pages = self.radix.match(seq.tokens, seq.namespace)
        length = min(length, limit)
        ps = self.pool.page_size
        if self.prefix_match == "block":
            length -= length % ps
        keep = -(-length // ps)
        self.pool.decref(pages[keep:])
        seq.table.release()
        seq.table = BlockTable(self.pool, pages[:keep], length)
        return length

    def restorable(self, seq: Sequence, limit: int) -> int:
        """Up to which position the tier can restore seq's KV (at most limit);
        at most what seq holds already when it can add nothing."""
        if self.tier is None:
            return seq.table.length
        return max(seq.table.length, self.tier.match(seq.key, seq.namespace, seq.tokens, limit))

    def restore(self, seq: Sequence, end: int) -> int:
        """Copy seq's KV up to position end from the tier (the pages must be free)."""
        restored = self.tier.restore(seq.key, seq.table, end)
        if restored:
            seq.last_logits = None
        return restored

    def _pins_order(self, pinned: list[Sequence], now: float) -> list[Sequence]:
        """The order idle sessions inside their pin give way: the least
        valuable first (bring-back seconds per second until due back), but
        first of all what a tenant pins beyond its share, the pool divided
        among the tenants holding pins; so one tenant's many pins never push
        out another's few, while each tenant's pins within its share hold
        in value order."""
        r = self.retention
        by_value = sorted(pinned, key=lambda s: self.bring_back_s(s) / max(r.expected_back(s) - now, MIN_WAIT_S))
        # Each owner's pinned pages, a page its sessions share (forks, copy-on-write) counted once.
        held: dict[str, Counter[int]] = {}
        for s in pinned:
            held.setdefault(owner_of(s.namespace), Counter()).update(s.table.pages)
        share = self.pool.num_pages // max(1, len(held))
        excess, within = [], []
        for s in by_value:
            pages = held[owner_of(s.namespace)]
            if len(pages) > share:
                pages.subtract(s.table.pages)
                for page in [p for p in s.table.pages if pages[p] <= 0]:
                    del pages[page]
                excess.append(s)
            else:
                within.append(s)
        return excess + within

    def worth_waiting_for(self, seq: Sequence, now: float) -> bool:
        """Whether a pinned idle sequence is due back closer than its bring-back
        cost, either side: making work wait for it (at most that long before
        and after it is expected) costs less than losing it. A wait of a
        recompute's length, no longer, as in ski rental."""
        return abs(self.retention.expected_back(seq) - now) < self.bring_back_s(seq)

    def make_room(self, pages: int, idle: Iterable[Sequence], soft_pins: bool = False,
                  busy_keys: frozenset[str] = frozenset(), wanted: frozenset[int] = frozenset(),
                  hold: frozenset[Sequence] = frozenset(), unplaced: frozenset[Sequence] = frozenset()) -> bool:
        """Free pages until `pages` are free: unused cached prefixes, then idle
        sequences past their pin in the retention policy's order, then the
        cached prefixes in `wanted` (those requests waiting for their program's
        admission will reuse: they are due back, unlike a session past its
        pin), and with soft_pins, then idle sequences still inside a finite
        pin but those in hold. busy_keys: the tier keys of sequences with a
        request. unplaced: idle sequences whose program holds no place
        (engine.programs: a guest's), which go with those past their pin.
        Whether enough are free."""
        if self.pool.num_free >= pages:
            return True
        now = time.monotonic()
        idle = [s for s in idle if s.expired(math.inf)]
        first = {s for s in idle if s.expired(now) or s in unplaced}
        self._give_way(pages, sorted(first, key=self.retention.eviction_key), busy_keys, wanted)
        if self.pool.num_free < pages:
            pinned = self._pins_order([s for s in idle if s not in first and s not in hold], now) if soft_pins else []
            self._give_way(pages, pinned, busy_keys, frozenset())
        return self.pool.num_free >= pages

    def last_resort(self, pages: int) -> bool:
        """After idle KV and preemption, before a request fails: pages only the
        prefix tree holds inside it (a prefix a session holds its own copy
        of, below a path it still uses) go with the whole tree. Whether
        `pages` are free then."""
        if self.radix is not None and self.pool.num_free < pages:
            self.radix.clear()
        return self.pool.num_free >= pages

    def _give_way(self, pages: int, order: list[Sequence], busy_keys: frozenset[str], keep: frozenset[int]) -> None:
        """Unused cached prefixes but those holding a page in keep, then the
        sequences of order, until `pages` are free."""
        if self.radix is not None:
            self.radix.evict(pages - self.pool.num_free, keep)
        for seq in order:
            if self.pool.num_free >= pages:
                break
            self.evict(seq, family_busy=seq.key in busy_keys)
            if self.radix is not None:
                self.radix.evict(pages - self.pool.num_free, keep)

    def cached_prefix(self, seq: Sequence) -> tuple[int, list[int]]:
        """What reuse_prefix would give the sequence now, as (length, pages),
        taking no reference and counting no hit: (0, []) when it holds KV
        already or there is no prefix cache. For estimates (program admission)
        and for what a waiting request would lose if those pages went."""
        if self.radix is None or seq.table.length:
            return 0, []
        return self.radix.peek(seq.tokens, seq.namespace)
