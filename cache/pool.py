"""A fixed pool of KV pages shared by all layers, with per-page refcounts.

One tensor holds every page of every layer: kv[layer, 0 or 1 (K or V), page,
slot, kv_head, head_dim] (stored head-major). Pages are handed out by a free list; a page returns
to it when its last holder lets go.
"""
from __future__ import annotations

import weakref
from typing import Iterable, Protocol

import torch

from agentkv.cache import hugepages
from agentkv.cache.errors import KVCapacityError, PageAccountingError


class PageHolder(Protocol):
    """Anything that keeps references to pages (a block table, a radix node)."""

    def held_pages(self) -> Iterable[int]: ...


class PagePool:
    live: "weakref.WeakSet[PagePool]" = weakref.WeakSet()

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need at least one page of at least one slot, got {num_pages} x {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        # Indexed [layer, K/V, page, slot, head, dim] but stored head-major, so
        # that a run of consecutive pages is one contiguous block per head:
        # attention over it needs no gather (see kernels.reference._by_head).
        # On huge pages where the OS has them: a decode step streams every
        # head's pages, and 4 KB pages cost it a TLB walk and a prefetcher
        # restart every 4 KB (docs/bench_cpu_attention.md, round 3).
        # One page more than num_pages, never handed out: where the padding
        # sequences of a fixed-shape step write their K/V (engine/decode_graphs.py).
        self.scratch_page = num_pages
        storage = hugepages.zeros(
            (num_layers, 2, num_kv_heads, num_pages + 1, page_size, head_dim), dtype=dtype, device=device
        )
        self.kv = storage.permute(0, 1, 3, 4, 2, 5)
        # Slot-addressed: [layer, K/V, head, page * page_size + slot, dim].
        self._slots = storage.view(num_layers, 2, num_kv_heads, (num_pages + 1) * page_size, head_dim)
        self.refcount = [0] * num_pages
        # A stack popped from the end: low page ids first, so a fresh sequence
        # tends to get consecutive pages.
        self._free = list(range(num_pages - 1, -1, -1))
        self._holders: "weakref.WeakSet[PageHolder]" = weakref.WeakSet()
        PagePool.live.add(self)

    @staticmethod
    def pages_for_budget(
        budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype
    ) -> int:
        page_bytes = num_layers * 2 * page_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
        return max(1, budget_bytes // page_bytes)

    @property
    def token_bytes(self) -> int:
        """Bytes of KV one token takes, over every layer."""
        L, _, H, _, D = self._slots.shape
        return L * 2 * H * D * self.kv.element_size()

    def read_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV in these slots as [token, layer, K/V, kv_head, head_dim] (a copy)."""
        return self._slots.index_select(3, slots).permute(3, 0, 1, 2, 4).contiguous()

    def write_slots(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Inverse of read_slots: kv [token, layer, K/V, kv_head, head_dim] into these slots."""
        self._slots.index_copy_(3, slots, kv.to(self._slots.device, self._slots.dtype).permute(1, 2, 3, 0, 4))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def register(self, holder: PageHolder) -> None:
        self._holders.add(holder)

    def alloc(self, n: int) -> list[int]:
        """n fresh pages with refcount 1, or KVCapacityError and nothing taken."""
        if n > len(self._free):
            raise KVCapacityError(n, len(self._free), self.page_size)
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self.refcount[p] < 1:
                raise PageAccountingError(f"incref of free page {p}")
            self.refcount[p] += 1

    def decref(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self.refcount[p] < 1:
                raise PageAccountingError(f"double free of page {p}")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    def check(self) -> None:
        """Raise PageAccountingError unless free + referenced == total, the free
        list has no duplicates or referenced pages, and each refcount equals
        the number of references its live holders keep."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise PageAccountingError("a page is on the free list twice")
        referenced = [p for p in range(self.num_pages) if self.refcount[p] > 0]
        if len(free) + len(referenced) != self.num_pages:
            raise PageAccountingError(
                f"free {len(free)} + referenced {len(referenced)} != total {self.num_pages}"
            )
        if free.intersection(referenced):
            raise PageAccountingError(f"pages both free and referenced: {sorted(free.intersection(referenced))}")
        held = [0] * self.num_pages
        for holder in list(self._holders):
            for p in holder.held_pages():
                held[p] += 1
        wrong = [p for p in range(self.num_pages) if held[p] != self.refcount[p]]
        if wrong:
            p = wrong[0]
            raise PageAccountingError(
                f"{len(wrong)} refcounts disagree with holders, e.g. page {p}: refcount "
                f"{self.refcount[p]}, held {held[p]} times"
            )
