"""Per-step attention metadata, built once per forward and read by every layer.

A step is a ragged batch: sequence i contributes ``query_lens[i]`` new tokens at
positions ``[seq_lens[i] - query_lens[i], seq_lens[i])``; their K/V are written to
the pages first, then every query attends to keys ``[0, its own position]`` of its
sequence (cached pages plus causally within the chunk).

The tensors live in persistent buffers (StepBuffers) that a runner keeps for
its whole life: a step writes into them and its metadata holds views, so no
step allocates a tensor once the buffers have grown to its size. They grow
by powers of two (tokens, sequences, pages per sequence), the same buckets a
CUDA graph would be captured at, and a step's host-side scalars (the shortest
and longest query, the longest sequence) are decided once, here, not by each
layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class AttnMetadata:
    cu_seqlens_q: torch.Tensor  # [B+1] int32, offsets of each sequence's queries in the token dim
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens of each sequence
    # [B, max_pages] int32, page ids (unused tail entries are 0). A view of a
    # wider persistent buffer: rows are contiguous, stride(0) is the buffer's.
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64, page * page_size + offset of each new token
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    page_size: int
    query_lens_list: list[int]
    seq_lens_list: list[int]
    min_query_len: int
    max_query_len: int
    # At least the longest seq_len, and used only as that bound (a split-K
    # grid, "no window"): a fixed-shape step sets it from its bucket, so that
    # it does not change from step to step (engine/decode_graphs.py).
    max_seq_len: int
    # The torch path's key blocks and masks by (sliding window, the query
    # count up to which another kernel runs a sequence; see
    # kernels.reference._torch_plan), made on first use and then shared by
    # every layer of the step.
    torch_plans: dict[tuple[int, int], list] = field(default_factory=dict)
    # The torch path's RoPE factors at the step's positions, with the cos
    # table they came from (see kernels.reference.rope_and_store), likewise
    # made once per step.
    torch_rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttnMetadata":
        """The metadata of one ragged step from plain Python lists, in buffers
        of its own (a runner keeps a StepBuffers and reuses them instead)."""
        return StepBuffers(page_size, device).build(query_lens, seq_lens, block_tables)


def bucket(n: int) -> int:
    """The power of two a buffer holding n entries is sized to (at least 1)."""
    return 1 << max(0, n - 1).bit_length()


class PersistentBuffer:
    """One persistent tensor (and a pinned host copy of it where the device is
    not the CPU), grown to a power of two when a step needs more. The host
    side is written through a numpy view: a numpy op on a few entries costs a
    fraction of a torch op's dispatch. `allocations` counts the times it was
    (re)made."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str = "cpu", width: int | None = None):
        self.dtype, self.device, self.width = dtype, torch.device(device), width
        self.rows = 0
        self.allocations = 0
        self.host = self.tensor = torch.empty(self.shape(0), dtype=dtype)
        self.np: np.ndarray = self.host.numpy()
        # Slicing a tensor is a dispatched op: a step of the last one's shape
        # reuses its views (rows, cols, host view, device view).
        self._last_view: tuple | None = None

    def shape(self, rows: int) -> tuple[int, ...]:
        return (rows,) if self.width is None else (rows, self.width)

    def ensure(self, rows: int, width: int | None = None) -> bool:
        """Room for rows (and width columns); returns whether it grew, which
        keeps nothing of what it held."""
        if rows <= self.rows and (width is None or width <= self.width):
            return False
        self.rows = bucket(max(rows, self.rows))
        if width is not None:
            self.width = bucket(max(width, self.width))
        pin = self.device.type == "cuda"
        self.host = torch.zeros(self.shape(self.rows), dtype=self.dtype, pin_memory=pin)
        self.tensor = self.host if self.device.type == "cpu" else torch.zeros_like(self.host, device=self.device)
        self.np = self.host.numpy()
        self._last_view = None
        self.allocations += 1
        return True

    def view(self, rows: int, cols: int | None = None) -> torch.Tensor:
        """The device tensor's first rows (and cols), after copying them there."""
        last = self._last_view
        if last is not None and last[0] == rows and last[1] == cols:
            host, dev = last[2], last[3]
        else:
            host = self.host[:rows] if cols is None else self.host[:rows, :cols]
            dev = host if self.tensor is self.host else self.tensor[:rows] if cols is None else self.tensor[:rows, :cols]
            self._last_view = rows, cols, host, dev
        if dev is not host:
            dev.copy_(host)
        return dev


class StepBuffers:
    """A runner's persistent metadata buffers, reused by every step.

    `build` fills them from the step's lists and returns AttnMetadata whose
    tensors are views of them. `allocations` counts the times a buffer was
    (re)made: after warm-up at the largest step shapes it stays put.

    Block tables are kept across steps row by row: a row is rewritten only
    from where the step's table stops matching what the row holds, so a
    decode step writes no page id at all unless a sequence crossed a page."""

    def __init__(self, page_size: int, device: torch.device | str = "cpu"):
        self.page_size = page_size
        self._cu = PersistentBuffer(torch.int32, device)
        self._seq_lens = PersistentBuffer(torch.int32, device)
        self._slots = PersistentBuffer(torch.int64, device)
        self._positions = PersistentBuffer(torch.int64, device)
        self._tables = PersistentBuffer(torch.int32, device, width=0)
        self._rows: list[list[int]] = []  # what each row of the tables buffer holds, zeros after it
        self._cu_of: list[int] | None = None  # the query_lens the offsets buffer holds

    @property
    def allocations(self) -> int:
        return sum(b.allocations for b in (self._cu, self._seq_lens, self._slots, self._positions, self._tables))

    def reserve(self, seqs: int, pages: int, tokens: int) -> None:
        """Size the buffers now for steps of up to seqs sequences, pages pages
        each and tokens tokens in all, so that no such step grows (moves)
        them: a captured CUDA graph reads the addresses it was captured with."""
        if self._cu.ensure(seqs + 1):
            self._cu_of = None
        for buf, rows in ((self._seq_lens, seqs), (self._slots, tokens), (self._positions, tokens)):
            buf.ensure(rows)
        if self._tables.ensure(seqs, pages):
            self._rows = []

    def build(
        self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], max_seq_len: int | None = None
    ) -> AttnMetadata:
        """Checks the lists, then fills the buffers; bad input changes nothing.
        max_seq_len: the bound the metadata reports (see AttnMetadata), at
        least the longest of seq_lens, which it is by default."""
        ps = self.page_size
        if not (len(query_lens) == len(seq_lens) == len(block_tables)) or not query_lens:
            raise ValueError("query_lens, seq_lens and block_tables must be non-empty and of one length")
        longest = max(seq_lens)
        if max_seq_len is not None and max_seq_len < longest:
            raise ValueError(f"max_seq_len {max_seq_len} is below the longest sequence, {longest}")
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            if q_len < 1 or s_len < q_len:
                raise ValueError(f"bad lengths: query_len={q_len}, seq_len={s_len}")
            if len(table) * ps < s_len:
                raise ValueError(f"block table of {len(table)} pages cannot hold {s_len} tokens")
        n_seqs = len(query_lens)
        width = max(map(len, block_tables))
        self._fill_tables(block_tables, width)
        # Decode and fixed-k verify steps repeat their query lengths step
        # after step: their offsets are already in the buffer.
        if self._cu.ensure(n_seqs + 1) or query_lens != self._cu_of:
            cu = self._cu.np[: n_seqs + 1]
            cu[0] = 0
            np.cumsum(query_lens, out=cu[1:])
            self._cu_of = list(query_lens)
        num_tokens = int(self._cu.np[n_seqs])
        self._seq_lens.ensure(n_seqs)
        self._seq_lens.np[:n_seqs] = seq_lens
        self._positions.ensure(num_tokens)
        self._slots.ensure(num_tokens)
        if num_tokens == n_seqs:
            # One token each (decodes), at the sequence's last position. A few
            # Python ints cost less than the numpy ops of the general case,
            # which right after a forward find their code out of the caches.
            positions = [s - 1 for s in seq_lens]
            self._positions.np[:n_seqs] = positions
            self._slots.np[:n_seqs] = [t[p // ps] * ps + p % ps for t, p in zip(block_tables, positions)]
        else:
            q = np.asarray(query_lens, dtype=np.int64)
            s = np.asarray(seq_lens, dtype=np.int64)
            cu = self._cu.np[: n_seqs + 1]
            positions = self._positions.np[:num_tokens]
            # Token t of the step, the j-th of sequence i's chunk (t = cu[i] + j),
            # sits at position seq_len - query_len + j.
            seq_of_token = np.repeat(np.arange(n_seqs), q)
            np.add(np.repeat(s - q - cu[:-1], q), np.arange(num_tokens), out=positions)
            pages = self._tables.np[seq_of_token, positions // ps]
            np.add(np.multiply(pages, ps, dtype=np.int64), positions % ps, out=self._slots.np[:num_tokens])
        return AttnMetadata(
            cu_seqlens_q=self._cu.view(n_seqs + 1),
            seq_lens=self._seq_lens.view(n_seqs),
            block_tables=self._tables.view(n_seqs, width),
            slot_mapping=self._slots.view(num_tokens),
            positions=self._positions.view(num_tokens),
            page_size=ps,
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            min_query_len=min(query_lens),
            max_query_len=max(query_lens),
            max_seq_len=longest if max_seq_len is None else max_seq_len,
        )

    def _fill_tables(self, block_tables: list[list[int]], width: int) -> None:
        buf = self._tables
        if buf.ensure(len(block_tables), width):
            self._rows = []
        rows, table_np = self._rows, buf.np
        while len(rows) < len(block_tables):
            rows.append([])
        for i, pages in enumerate(block_tables):
            held = rows[i]
            n = len(held)
            if len(pages) >= n and pages[:n] == held:  # the common case: unchanged, or grown at the end
                if len(pages) > n:
                    table_np[i, n : len(pages)] = pages[n:]
                    held.extend(pages[n:])
                continue
            table_np[i, : len(pages)] = pages
            if n > len(pages):
                table_np[i, len(pages) : n] = 0
            rows[i] = list(pages)
