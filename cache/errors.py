"""Typed errors of the cache layer."""


class KVCapacityError(RuntimeError):
    """The page pool cannot hold what was asked; nothing was changed."""

    def __init__(self, needed: int, available: int, page_size: int):
        super().__init__(
            f"KV cache out of capacity: need {needed} more pages of {page_size} tokens, "
            f"{available} free"
        )
        self.needed = needed
        self.available = available


class PageAccountingError(AssertionError):
    """The pool's invariant free + referenced == total, or a refcount, is broken."""
