"""Decode and fixed-length verify steps at fixed shapes, replayed as CUDA graphs.

A step whose B items all append q tokens and want the logits of every one (a
decode step: q = 1; a verify of q - 1 drafts each) runs as bucket(B)
sequences: its B, then padding sequences of q tokens that write their K/V
into the pool's scratch page. Its inputs live in buffers sized once, for the
largest batch and the longest context, so every step of a key (batch bucket,
q, a bucket of the longest sequence) hands the model tensors at the same
addresses with the same shapes, and every host-side value a kernel reads
(the sequence and token counts, the query length, AttnMetadata.max_seq_len)
is the key's. On a GPU each key's forward is captured once as a CUDA graph
and replayed after the step's metadata is copied into those buffers;
elsewhere, or with capture off, the same padded forward runs eagerly over
the same buffers, which is how the CPU tests exercise this path. Prefill
chunks and mixed steps run eagerly (engine/runner.py).

A graph holds the addresses of the model's weights: writes into them in
place are seen, a weight replaced by another tensor is not (make a new
engine). The key count is bounded: log2 of the batch bucket, times the
query lengths that occur (decode and the drafters' lengths), times log2 of
the context bucket.
"""
from __future__ import annotations

import logging
from itertools import chain

import torch

from agentkv.cache.pool import PagePool
from agentkv.engine.step_item import StepItem
from agentkv.kernels.metadata import PersistentBuffer, StepBuffers, bucket
from agentkv.model.llama import ForwardScratch, Transformer

log = logging.getLogger(__name__)

MAX_BATCH = 64  # sequences a fixed-shape step takes; larger batches run eagerly
MAX_QUERY = 16  # tokens each (a verify of up to 15 drafts)
# The smallest context bucket: the split-K grid (kernels/triton_paged_attention.py)
# stops growing with the context below about 8 splits of 512 keys, so shorter
# buckets would only add graphs.
MIN_SEQ_BUCKET = 4096

Key = tuple[int, int, int]  # (sequences, tokens each, bucket of the longest sequence)


class DecodeGraphs:
    """A runner's fixed-shape steps over one model and page pool; see the
    module's docstring. capture: record CUDA graphs (None: where the pool is
    on a CUDA device)."""

    def __init__(
        self, model: Transformer, pool: PagePool, max_context: int, max_batch: int = MAX_BATCH,
        capture: bool | None = None,
    ):
        device = pool.kv.device
        if capture is None:
            capture = device.type == "cuda"
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        if max_batch < 1 or max_context < 1:
            raise ValueError(f"max_batch and max_context must be >= 1, got {max_batch}, {max_context}")
        self.model, self.pool, self.capture = model, pool, capture
        ps = pool.page_size
        self.max_batch = bucket(max_batch)
        # The most pages a sequence can hold, and so the longest one a step may take.
        self.width = min(-(-max_context // ps), pool.num_pages)
        self.capacity = self.width * ps
        self.buffers = StepBuffers(ps, device)
        self.buffers.reserve(self.max_batch, self.width, self.max_batch * MAX_QUERY)
        rows = max(self.max_batch * MAX_QUERY, model.min_rows)
        self._ids = PersistentBuffer(torch.int64, device)
        self._ids.ensure(rows)
        # Its own attention rows, at their largest now: a graph keeps writing
        # the rows it was captured with, so they must never be remade (as an
        # eager step growing the runner's would remake those).
        self._scratch = ForwardScratch(pool.kv)
        cfg = model.cfg
        self._scratch.attention_rows(rows, rows, cfg.num_heads, cfg.head_dim, model.dtype)
        self._graphs: dict[Key, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._memory = torch.cuda.graph_pool_handle() if capture else None
        self.keys: set[Key] = set()  # every key run, captured or not
        self.captures = 0
        self.replays = 0

    def key(self, items: list["StepItem"]) -> Key | None:
        """The key a step runs under here, or None where it runs eagerly.
        Called after the step's pages are reserved, before its tables advance."""
        q = len(items[0].tokens)
        if len(items) > self.max_batch or q > MAX_QUERY:
            return None
        if any(len(it.tokens) != q or it.num_logits != q for it in items):
            return None
        longest = max(it.table.length for it in items) + q
        if longest > self.capacity:
            return None
        return bucket(len(items)), q, min(max(MIN_SEQ_BUCKET, bucket(longest)), self.capacity)

    def forward(self, items: list["StepItem"], key: Key) -> torch.Tensor:
        """fp32 logits [len(items) * q, vocab] of a step under its key (see key)."""
        seqs, q, max_seq_len = key
        pad = seqs - len(items)
        scratch = [self.pool.scratch_page] * -(-q // self.pool.page_size)
        meta = self.buffers.build(
            [q] * seqs,
            [it.table.length + q for it in items] + [q] * pad,
            [it.table.pages for it in items] + [scratch] * pad,
            max_seq_len,
        )
        rows = max(seqs * q, self.model.min_rows)
        if self._ids.ensure(rows):  # only where the model's packing changed: captured rows moved
            self._graphs.clear()
        n = len(items) * q
        # Past the step's ids the buffer holds valid ids (zeros or an earlier
        # step's): the padding sequences' and the model's padding rows.
        self._ids.np[:n] = list(chain.from_iterable(it.tokens for it in items))
        ids = self._ids.view(rows)
        self.keys.add(key)

        def run() -> torch.Tensor:
            return self.model(ids, meta, self.pool.kv, None, self._scratch)

        if not self.capture:
            return run()[:n]
        graph = self._graphs.get(key)
        if graph is None:
            return self._record(key, run)[:n]
        graph[0].replay()
        self.replays += 1
        # The output is the graph's, rewritten by its next replay; callers keep logits.
        return graph[1][:n].clone()

    def _record(self, key: Key, run) -> torch.Tensor:
        """Capture run's kernels for key and return the step's logits. The
        warm-up computes the step eagerly (and compiles what the kernels
        need; its K/V writes are the ones the replay repeats); the first
        replay must give its logits. A capture that fails or disagrees turns
        capture off, with one warning: fixed-shape steps then run eagerly."""
        device = self.pool.kv.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            eager = run().clone()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._memory):
                out = run()
            graph.replay()
            if not torch.allclose(out, eager, atol=1e-3, rtol=1e-3):
                raise RuntimeError(f"the replay's logits differ from the eager step's by up to "
                                   f"{(out - eager).abs().max().item():.3g}")
        except RuntimeError as e:
            log.warning("CUDA graphs off, fixed-shape steps run eagerly from now on: capture of %s: %s", key, e)
            self.capture = False
            self._graphs.clear()
            return eager
        self._graphs[key] = graph, out
        self.captures += 1
        self.replays += 1
        return out.clone()
