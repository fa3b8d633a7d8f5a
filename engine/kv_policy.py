"""Where a sequence's KV comes from and what gives way under memory pressure.

A sequence holding no KV (new, parked or preempted) starts from the longest
prefix of its tokens the radix cache holds. When a step needs pages, what
nobody uses goes first: cached prefixes no sequence holds (least recently
used first), then the pages of sequences idle past their pin time (longest
idle first), which are published to the prefix cache as they go, so a
later turn can still match whatever the cache keeps. Next the scheduler
preempts lower-priority requests; only when none is left do idle sequences
still inside their pin time give way (soft pins), rather than a request
failing. A sequence pinned for good (pin_ttl None) never does.
"""
from __future__ import annotations

import math
import time
from typing import Iterable

from cache.block_table import BlockTable
from cache.pool import PagePool
from cache.radix import RadixCache
from engine.sequence import Sequence


class KVPolicy:
    def __init__(self, pool: PagePool, radix: RadixCache | None, prefix_match: str = "token"):
        # "block" reuses whole pages only, as block-hash caches (vLLM) and
        # page-aligned radix trees do: the baseline token granularity beats.
        if prefix_match not in ("token", "block"):
            raise ValueError(f"prefix_match must be 'token' or 'block', not {prefix_match!r}")
        self.pool, self.radix, self.prefix_match = pool, radix, prefix_match

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

    def make_room(self, pages: int, idle: Iterable[Sequence], soft_pins: bool = False) -> bool:
        """Free pages until `pages` are free: unused cached prefixes, then idle
        sequences past their pin time (with soft_pins, any idle sequence with
        a pin time), longest idle first. Whether enough are free."""
        if self.pool.num_free >= pages:
            return True
        if self.radix is not None:
            self.radix.evict(pages - self.pool.num_free)
        now = time.monotonic()
        ready = (s for s in idle if s.expired(now) or (soft_pins and s.expired(math.inf)))
        for seq in sorted(ready, key=lambda s: s.idle_since):
            if self.pool.num_free >= pages:
                break
            self.release(seq)
            if self.radix is not None:
                self.radix.evict(pages - self.pool.num_free)
        return self.pool.num_free >= pages
