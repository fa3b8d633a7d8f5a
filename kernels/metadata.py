"""Per-step attention metadata, built once per forward and read by every layer.

A step is a ragged batch: sequence i contributes ``query_lens[i]`` new tokens at
positions ``[seq_lens[i] - query_lens[i], seq_lens[i])``; their K/V are written to
the pages first, then every query attends to keys ``[0, its own position]`` of its
sequence (cached pages plus causally within the chunk).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    # Gather indices and masks for the torch path by sliding window, made on
    # first use and then shared by every layer of the step.
    torch_plans: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = field(default_factory=dict)

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
        """Build the metadata of a ragged step from plain Python lists."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)) or not query_lens:
            raise ValueError("query_lens, seq_lens and block_tables must be non-empty and of one length")
        positions: list[int] = []
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            if q_len < 1 or s_len < q_len:
                raise ValueError(f"bad lengths: query_len={q_len}, seq_len={s_len}")
            if len(table) * page_size < s_len:
                raise ValueError(f"block table of {len(table)} pages cannot hold {s_len} tokens")
            for pos in range(s_len - q_len, s_len):
                positions.append(pos)
                slots.append(table[pos // page_size] * page_size + pos % page_size)
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        cu = [0]
        for q_len in query_lens:
            cu.append(cu[-1] + q_len)
        return AttnMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            page_size=page_size,
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
        )
