"""A sequence's pages: which pool pages hold its KV, and how many slots are filled.

Pages may be shared with other holders (a fork, the radix tree). A shared page
is never written: before the first write into it, it is copied to a private
page (copy-on-write). Whole pages past a sequence's end are never kept.
"""
from __future__ import annotations

import weakref

import torch

from agentkv.cache.pool import PagePool


class BlockTable:
    def __init__(self, pool: PagePool, pages: list[int] | None = None, length: int = 0):
        self.pool = pool
        self.pages: list[int] = list(pages or [])
        self.length = length
        pool.register(self)
        # A dropped, unreleased table gives its pages back when collected.
        weakref.finalize(self, pool.decref, self.pages)

    def held_pages(self) -> list[int]:
        return self.pages

    def __len__(self) -> int:
        return self.length

    def pages_needed(self, n: int) -> int:
        """Fresh pages an append of n tokens takes, counting a copy-on-write copy."""
        ps = self.pool.page_size
        new = -(-(self.length + n) // ps) - len(self.pages)
        return max(new, 0) + int(self._first_write_page_shared(n))

    def _first_write_page_shared(self, n: int) -> bool:
        idx = self.length // self.pool.page_size
        return n > 0 and idx < len(self.pages) and self.pool.refcount[self.pages[idx]] > 1

    def reserve(self, n: int) -> list[tuple[int, int]]:
        """Make room for n more tokens: allocate pages and privatise a shared
        page about to be written. Returns the (src, dst) page copies the caller
        must perform before writing. All or nothing: KVCapacityError leaves the
        table unchanged. The length is not advanced (see advance)."""
        ps = self.pool.page_size
        fresh = self.pool.alloc(self.pages_needed(n))
        copies = []
        if self._first_write_page_shared(n):
            idx = self.length // ps
            src, dst = self.pages[idx], fresh.pop()
            self.pages[idx] = dst
            self.pool.decref([src])
            copies.append((src, dst))
        self.pages.extend(fresh)
        return copies

    def advance(self, n: int) -> None:
        if self.length + n > len(self.pages) * self.pool.page_size:
            raise ValueError(f"advance by {n} past the reserved pages")
        self.length += n

    def truncate(self, n: int) -> None:
        """Keep the first n tokens; release pages wholly past them."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a sequence of {self.length} tokens to {n}")
        keep = -(-n // self.pool.page_size)
        dropped = self.pages[keep:]
        del self.pages[keep:]
        self.pool.decref(dropped)
        self.length = min(self.length, n)

    def fork(self) -> "BlockTable":
        """A table sharing every page; a later write on either side copies first."""
        self.pool.incref(self.pages)
        return BlockTable(self.pool, self.pages, self.length)

    def slot(self, pos: int) -> int:
        ps = self.pool.page_size
        return self.pages[pos // ps] * ps + pos % ps

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Slot ids of positions [start, end), on the pool's device."""
        ps = self.pool.page_size
        pos = torch.arange(start, end)
        pages = torch.tensor(self.pages, dtype=torch.long)[pos // ps]
        return (pages * ps + pos % ps).to(self.pool.kv.device)

    def release(self) -> None:
        self.truncate(0)
