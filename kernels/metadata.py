"""Per-step attention metadata, built once per forward and read by every layer.

A step is a ragged batch: sequence i contributes ``query_lens[i]`` new tokens at
positions ``[seq_lens[i] - query_lens[i], seq_lens[i])``; their K/V are written to
the pages first, then every query attends to keys ``[0, its own position]`` of its
sequence (cached pages plus causally within the chunk).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttnMetadata:
    cu_seqlens_q: torch.Tensor  # [B+1] int32, offsets of each sequence's queries in the token dim
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens of each sequence
    block_tables: torch.Tensor  # [B, max_pages] int32, page ids (unused tail entries are 0)
    slot_mapping: torch.Tensor  # [T] int64, page * page_size + offset of each new token
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    page_size: int
    query_lens_list: list[int]
    seq_lens_list: list[int]
    # The torch path's key blocks and masks by sliding window (see
    # kernels.reference._torch_plan), made on first use and then shared by
    # every layer of the step.
    torch_plans: dict[int, list[tuple[list[slice | torch.Tensor], torch.Tensor | None]]] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_list)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list)

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttnMetadata":
        """Build the metadata of a ragged step from plain Python lists (per token
        with tensor ops: a long prefill chunk costs no Python loop)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)) or not query_lens:
            raise ValueError("query_lens, seq_lens and block_tables must be non-empty and of one length")
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            if q_len < 1 or s_len < q_len:
                raise ValueError(f"bad lengths: query_len={q_len}, seq_len={s_len}")
            if len(table) * page_size < s_len:
                raise ValueError(f"block table of {len(table)} pages cannot hold {s_len} tokens")
        width = max(len(t) for t in block_tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        cu = F.pad(q_lens.cumsum(0), (1, 0))
        tokens = torch.arange(int(cu[-1]))
        # Each token's sequence as a running count of the sequence starts
        # before it: repeat_interleave and searchsorted hand even tiny inputs
        # to OpenMP threads, which took 8 ms on two busy cores.
        starts = torch.zeros_like(tokens)
        starts[cu[1:-1]] = 1
        seq_of_token = starts.cumsum(0)
        # Token t of the step, the j-th of sequence i's chunk (t = cu[i] + j),
        # sits at position seq_len - query_len + j.
        first = torch.tensor(seq_lens, dtype=torch.int64) - q_lens - cu[:-1]
        positions = first[seq_of_token] + tokens
        slots = table[seq_of_token, positions // page_size] * page_size + positions % page_size
        return AttnMetadata(
            cu_seqlens_q=cu.to(device, torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=table.to(device, torch.int32),
            slot_mapping=slots.to(device),
            positions=positions.to(device),
            page_size=page_size,
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
        )
