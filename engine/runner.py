"""The one forward of the engine: append chunks of tokens to sequences.

Prefill, a turn's delta, a decode step and a speculative verify are all a
`step`: each item names a sequence's block table, its new tokens and how many
trailing logits it wants. Pages are reserved for every item at once (all or
nothing), shared pages about to be written are copied first, then a single
ragged forward writes the K/V and returns the logits.

Everything a step hands the model (token ids, the logit rows, the attention
metadata) is written into persistent buffers the runner keeps for its life
(kernels.metadata.StepBuffers), so a step allocates no input tensor once they
have grown to its size. With graphs, decode and fixed-length verify steps run
at fixed shapes instead, as CUDA graphs on a GPU (engine/decode_graphs.py).
"""
from __future__ import annotations

from itertools import chain

import torch

from agentkv.kernels import dispatch
from agentkv.cache.errors import KVCapacityError
from agentkv.cache.pool import PagePool
from agentkv.engine.decode_graphs import DecodeGraphs
from agentkv.engine.step_item import StepItem
from agentkv.kernels.metadata import PersistentBuffer, StepBuffers
from agentkv.model.llama import ForwardScratch, Transformer


class ModelRunner:
    def __init__(self, model: Transformer, pool: PagePool, graphs: DecodeGraphs | None = None):
        self.model = model
        self.pool = pool
        self.graphs = graphs
        device = model.device
        self.buffers = StepBuffers(pool.page_size, device)
        self._ids = PersistentBuffer(torch.int64, device)
        self._logit_rows = PersistentBuffer(torch.int64, device)
        self._scratch = ForwardScratch(pool.kv)

    @property
    def allocations(self) -> int:
        """How many times a step's input buffers were (re)made: constant once
        the runner has seen its largest step."""
        return self.buffers.allocations + self._ids.allocations + self._logit_rows.allocations

    def step(self, items: list[StepItem]) -> list[torch.Tensor]:
        """Compute the K/V of every item's tokens; return each item's logits
        [num_logits, vocab] (fp32). On any error no table has changed. The
        scheduler makes room first; a step short of pages fails whole."""
        needed = sum(it.table.pages_needed(len(it.tokens)) for it in items)
        if needed > self.pool.num_free:
            raise KVCapacityError(needed, self.pool.num_free, self.pool.page_size)
        old_lengths = [it.table.length for it in items]
        try:
            copies = [c for it in items for c in it.table.reserve(len(it.tokens))]
            if copies:
                src, dst = zip(*copies)
                device = self.pool.kv.device
                dispatch.copy_pages(self.pool.kv, torch.tensor(src, device=device), torch.tensor(dst, device=device))
            logits = self._forward(items)
        except BaseException:
            for it, n in zip(items, old_lengths):
                it.table.truncate(n)
            raise
        for it in items:
            it.table.advance(len(it.tokens))
        if len(items) == 1:  # a split is a dispatched op, and a costly one right after a forward
            return [logits]
        return list(logits.split([it.num_logits for it in items]))

    def _forward(self, items: list[StepItem]) -> torch.Tensor:
        if self.graphs is not None and (key := self.graphs.key(items)) is not None:
            return self.graphs.forward(items, key)
        query_lens = [len(it.tokens) for it in items]
        meta = self.buffers.build(
            query_lens,
            [it.table.length + q for it, q in zip(items, query_lens)],
            [it.table.pages for it in items],
        )
        num_tokens = meta.num_tokens
        # Past the step's ids the buffer holds valid ids (zeros, or an earlier
        # step's), which the model runs as padding rows (Transformer.min_rows).
        rows_run = max(num_tokens, self.model.min_rows)
        self._ids.ensure(rows_run)
        self._ids.np[:num_tokens] = list(chain.from_iterable(it.tokens for it in items))
        ids = self._ids.view(rows_run)
        rows = None
        if any(it.num_logits != q for it, q in zip(items, query_lens)):
            logit_rows, end = [], 0
            for it, q in zip(items, query_lens):
                end += q
                logit_rows.extend(range(end - it.num_logits, end))
            self._logit_rows.ensure(len(logit_rows))
            self._logit_rows.np[: len(logit_rows)] = logit_rows
            rows = self._logit_rows.view(len(logit_rows))
        # forward, not Module.__call__: no hooks are used, and its bookkeeping
        # is paid on every step (docs/bench_host_step.md).
        return self.model.forward(ids, meta, self.pool.kv, rows, self._scratch)
