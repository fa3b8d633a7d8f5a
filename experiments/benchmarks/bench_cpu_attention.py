"""CPU decode attention over the paged KV pool: the torch reference (page-run
matmuls) against the in-place C++ kernel (kernels/cpu_paged_attention.py), as
attention-only time and effective GB/s of the K/V read next to a plain memory
read measured in the same run; then decode ms/token of whole models, old path
(AGENTKV_KERNELS=torch) against new.

Attention: one sequence (--batch of them, their first --shared-prefix keys in
pages each of --groups groups holds in common) at each --contexts length in a pool of --layers
layers (the SmolLM2-135M shape's heads by default), so that a step's K/V
(all layers) is far larger than the caches, as in a model; a step is
attention over every layer for --queries new tokens (1: decode, k+1: verify).
Memory read: torch's sum over a 1 GiB fp32 buffer, same threads, twice: on
4 KB pages (torch's allocator) and placed as the pool is (2 MB pages where
the OS gives them); "cpp / read" is against the latter, like against like.
"cpp" prefetches as kernels/cpu_paged_attention.tune_prefetch chose on the
case's pool ("prefetch": tiles ahead, 0 for none); "pf<N> ms" times each
choice it had, side by side.

--baseline REV adds the kernel as it was at git revision REV ("base"),
built beside today's and timed alternately with it in the same run.

Decode: a random-init --shape model and the embedded models/agent-8m, one
session grown to each --decode-contexts length, --decode-tokens single-token
steps timed, old and new paths alternating per repeat.

    python -m agentkv.experiments.benchmarks.bench_cpu_attention [--contexts 4096,8192,16384] [--threads 1,2]
        [--dtypes float32,bfloat16] [--queries 1] [--repeats 7] [--baseline REV]
        [--batch 16 --shared-prefix 4096 --groups 2]
        [--decode-contexts 8192] [--decode-tokens 16] [--skip-decode] [--skip-attention]

Writes runs/bench_cpu_attention-<time>/{results.json, report.txt}.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from agentkv.cache import hugepages
from agentkv.cache.pool import PagePool
from agentkv.experiments.common import SHAPES, environ, machine, median, run_dir
from agentkv.experiments.report import table, write_json
from agentkv.kernels import cpu_extension, cpu_paged_attention, reference
from agentkv.kernels.metadata import AttnMetadata
from agentkv.model.config import ModelConfig

PATHS = {"torch": reference.paged_attention, "cpp": cpu_paged_attention.paged_attention}


def read_bandwidth(repeats: int, huge_pages: bool = False) -> float:
    """GB/s of a plain streaming read (sum of 1 GiB of fp32): on torch's
    allocator's ordinary 4 KB pages, or with huge_pages placed as the KV pool
    is (cache.hugepages: 2 MB pages where the OS gives them), so that the
    kernel's K/V read is compared with a read of memory like its own."""
    n = 1 << 28
    buf = hugepages.zeros((n,), torch.float32).fill_(1.0) if huge_pages else torch.ones(n)
    buf.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return buf.numel() * 4 / median(times) / 1e9


# The files of the decode kernel at a revision: its source and the headers
# it includes (shared with the chunk kernel; the ISA-named library since
# revisions have one).
KERNEL_FILES = ("cpu_paged_attention.cpp", "cpu_attention.h", "cpu_library.h")


def kernel_variant(files: dict[str, str]) -> Callable:
    """cpu_paged_attention.paged_attention's decode path on another version of
    its C++ files (KERNEL_FILES' texts, the header where that version has
    one), built as an extension of its own (op namespace renamed) from a
    folder of its own, so that old and new kernels run side by side in one
    process."""
    source = files["cpu_paged_attention.cpp"]
    tag = hashlib.sha1("".join(files.values()).encode()).hexdigest()[:10]
    ns = f"agentkv_variant_{tag}"
    renamed = source.replace("AGENTKV_LIBRARY(agentkv_cpu,", f"AGENTKV_LIBRARY({ns},")
    if renamed == source:  # a revision before the ISA-named libraries: today's header names it
        renamed = '#include "cpu_library.h"\n' + source.replace("TORCH_LIBRARY(agentkv_cpu,", f"AGENTKV_LIBRARY({ns},")
    if ns not in renamed:
        raise ValueError("the source registers no AGENTKV_LIBRARY(agentkv_cpu, ...) or TORCH_LIBRARY(agentkv_cpu, ...)")
    folder = Path(tempfile.gettempdir()) / ns
    folder.mkdir(exist_ok=True)
    (folder / f"{ns}.cpp").write_text(renamed)
    headers = {"cpu_library.h": cpu_extension.LIBRARY_HEADER.read_text(), **files}
    for name, text in headers.items():
        if name.endswith(".h"):
            (folder / name).write_text(text)
    ext = cpu_extension.Extension(ns, folder / f"{ns}.cpp", ns,
                                  lambda library: getattr(torch.ops, library).paged_attention_few,
                                  headers=[folder / name for name in headers if name.endswith(".h")])
    op = ext.load()
    # Revisions before the prefetch distance was an argument prefetch as they were built.
    takes_prefetch = any(a.name == "prefetch" for a in op.default._schema.arguments)

    def paged_attention(q, k_cache, v_cache, meta: AttnMetadata, scale: float, sliding_window: int = 0):
        out = torch.empty(q.shape, dtype=q.dtype)
        prefetch = (cpu_paged_attention.prefetch_tiles(),) if takes_prefetch else ()
        op(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale, sliding_window,
           cpu_paged_attention.MAX_QUERIES[q.dtype], cpu_paged_attention.SPLIT, *prefetch, out)
        return out

    return paged_attention


def source_at(rev: str) -> dict[str, str]:
    """KERNEL_FILES at git revision rev (those it has)."""
    files = {}
    for name in KERNEL_FILES:
        shown = subprocess.run(["git", "show", f"{rev}:kernels/{name}"], capture_output=True, text=True)
        if shown.returncode == 0:
            files[name] = shown.stdout
    if KERNEL_FILES[0] not in files:
        raise SystemExit(f"--baseline {rev}: no kernels/{KERNEL_FILES[0]} there")
    return files


def attention_case(cfg: ModelConfig, dtype: torch.dtype, context: int, num_q: int, layers: int, page_size: int,
                   placement: str, gen: torch.Generator, batch: int = 1, shared: int = 0, groups: int = 1):
    """A pool and one step of `batch` sequences of `context` keys and num_q
    queries each, whose first `shared` keys (whole pages) lie in pages that
    the sequences of each of `groups` groups hold in common (agents of one
    role on its prompt, as the radix cache shares it)."""
    per_seq, held = -(-context // page_size), min(shared, context) // page_size
    num_pages = groups * held + batch * (per_seq - held) + 1
    pool = PagePool(layers, cfg.num_kv_heads, cfg.head_dim, num_pages, page_size, dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(dtype))
    pages = list(range(num_pages - 1))
    if placement == "random":
        pages = torch.randperm(num_pages, generator=gen)[: num_pages - 1].tolist()
    own = pages[groups * held:]
    tables = [pages[b % groups * held:(b % groups + 1) * held] + own[b * (per_seq - held):(b + 1) * (per_seq - held)]
              for b in range(batch)]
    meta = AttnMetadata.build([num_q] * batch, [context] * batch, tables, page_size)
    q = torch.randn(batch * num_q, cfg.num_heads, cfg.head_dim, generator=gen).to(dtype)
    return pool, meta, q


def time_attention(impl, pool: PagePool, meta: AttnMetadata, q: torch.Tensor, scale: float) -> float:
    t = time.perf_counter()
    for layer in range(pool.kv.shape[0]):
        impl(q, pool.kv[layer, 0], pool.kv[layer, 1], meta, scale)
    return time.perf_counter() - t


def bench_attention(args) -> list[dict]:
    cfg = ModelConfig.from_hf(SHAPES[args.shape])
    gen = torch.Generator().manual_seed(0)
    scale = cfg.head_dim**-0.5
    paths = dict(PATHS)
    for tiles in cpu_paged_attention.PREFETCH_CHOICES:  # "cpp" takes the tuned one of these
        paths[f"pf{tiles}"] = functools.partial(cpu_paged_attention.paged_attention, prefetch=tiles)
    if args.baseline:
        paths["base"] = kernel_variant(source_at(args.baseline))
    rows = []
    cases = [(d, c, n) for d in args.dtypes.split(",") for c in args.contexts for n in args.threads]
    for dtype_name, context, threads in tqdm(cases, desc="attention"):
        torch.set_num_threads(threads)
        dtype = getattr(torch, dtype_name)
        pool, meta, q = attention_case(cfg, dtype, context, args.queries, args.layers, args.page_size,
                                       args.placement, gen, args.batch, args.shared_prefix, args.groups)
        tuned = cpu_paged_attention.tune_prefetch([(pool.kv[i, 0], pool.kv[i, 1]) for i in range(args.layers)],
                                                  cfg.num_heads)
        # As every sequence reads them: shared pages count once per sequence.
        kv_bytes = args.batch * args.layers * 2 * context * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        mem_small = read_bandwidth(args.repeats)
        mem = read_bandwidth(args.repeats, huge_pages=True)
        times = {p: [] for p in paths}
        for impl in paths.values():
            time_attention(impl, pool, meta, q, scale)  # warm-up (and the first build of the extension)
        for _ in range(args.repeats):
            for p, impl in paths.items():
                times[p].append(time_attention(impl, pool, meta, q, scale))
        mem = median([mem, read_bandwidth(args.repeats, huge_pages=True)])  # before and after the timings
        row = {"dtype": dtype_name, "context": context, "threads": threads, "batch": args.batch,
               "shared_prefix": args.shared_prefix, "groups": args.groups, "read_GBps": mem, "read_4k_GBps": mem_small,
               "kv_MB": kv_bytes / 1e6, "prefetch": tuned.tiles, "prefetch_tuning_ms": tuned.ms}
        for p in paths:
            t = median(times[p])
            row[f"{p}_ms"] = t * 1e3
            row[f"{p}_GBps"] = kv_bytes / t / 1e9
        rows.append(row)
        del pool
    return rows


def decode_ms(session, vocab: int, tokens: int, gen: torch.Generator) -> float:
    """ms per token of `tokens` single-token steps, the session cut back after."""
    start = len(session)
    ids = torch.randint(0, vocab, (tokens,), generator=gen).tolist()
    t = time.perf_counter()
    for tok in ids:
        session.append([tok])
    seconds = time.perf_counter() - t
    session.truncate(start)
    return seconds / tokens * 1e3


def bench_decode(args) -> list[dict]:
    from agentkv import Engine
    from agentkv.model.default import random_init, small_model_dir
    from agentkv.model.llama import Transformer
    from agentkv.model.loader import load_model

    gen = torch.Generator().manual_seed(1)
    rows = []
    models = [(args.shape, d) for d in args.dtypes.split(",")] + [("agent-8m", d) for d in args.dtypes.split(",")]
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, dtype in models:
            if name == "agent-8m":
                model = load_model(small_model_dir(), dtype)
            else:
                shape = dict(SHAPES[name])
                shape["max_position_embeddings"] = max(shape["max_position_embeddings"], max(args.decode_contexts) + 64)
                model = Transformer(ModelConfig.from_hf(shape), getattr(torch, dtype))
                random_init(model, 0)
            engine = Engine(model, None, page_size=args.page_size, kv_cache_bytes=args.kv_gb << 30)
            vocab = model.cfg.vocab_size
            session = engine.session()
            for context in args.decode_contexts:
                while len(session) < context:
                    session.append(torch.randint(0, vocab, (min(2048, context - len(session)),), generator=gen).tolist())
                times = {"torch": [], "auto": []}
                for mode in times:
                    with environ("AGENTKV_KERNELS", mode):
                        decode_ms(session, vocab, 2, gen)  # warm-up
                for _ in range(args.decode_repeats):
                    for mode in times:
                        with environ("AGENTKV_KERNELS", mode):
                            times[mode].append(decode_ms(session, vocab, args.decode_tokens, gen))
                old, new = median(times["torch"]), median(times["auto"])
                rows.append({"model": name, "dtype": dtype, "threads": threads, "context": context,
                             "old_ms": old, "new_ms": new, "new_tok_s": 1e3 / new})
            session.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--contexts", default="4096,8192,16384")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--queries", type=int, default=1, help="new tokens per sequence in the attention step")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--batch", type=int, default=1, help="sequences in the attention step")
    p.add_argument("--shared-prefix", type=int, default=0, help="keys each sequence holds in its group's common pages")
    p.add_argument("--groups", type=int, default=1, help="groups of sequences that share a prefix")
    p.add_argument("--placement", default="consecutive", choices=["consecutive", "random"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--decode-contexts", default="8192")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--decode-repeats", type=int, default=3)
    p.add_argument("--kv-gb", type=int, default=2)
    p.add_argument("--baseline", default="", help="git revision whose kernel runs beside today's")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-attention", action="store_true")
    args = p.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.threads = [int(t) for t in args.threads.split(",")]
    args.decode_contexts = [int(c) for c in args.decode_contexts.split(",")]
    if not cpu_paged_attention.available():
        raise SystemExit(f"the C++ kernel is not available: {cpu_paged_attention.build_error()}")
    out = run_dir("bench_cpu_attention")
    res = {"args": vars(args), "machine": machine(), "attention": [] if args.skip_attention else bench_attention(args)}
    base = ["base ms", "base / read"] if args.baseline else []
    choices = cpu_paged_attention.PREFETCH_CHOICES
    text = table(
        ["dtype", "context", "seqs", "shared", "threads", "K/V MB", "read 4K GB/s", "read GB/s", "torch ms", "torch GB/s", "cpp ms", "cpp GB/s",
         "cpp / read", "prefetch", *(f"pf{c} ms" for c in choices), *base],
        [[r["dtype"], r["context"], r["batch"], f"{r['shared_prefix']} x{r['groups']}", r["threads"], r["kv_MB"], r["read_4k_GBps"], r["read_GBps"], r["torch_ms"], r["torch_GBps"],
          r["cpp_ms"], r["cpp_GBps"], f"{r['cpp_GBps'] / r['read_GBps']:.2f}", r["prefetch"],
          *(r[f"pf{c}_ms"] for c in choices)]
         + ([r["base_ms"], f"{r['base_GBps'] / r['read_GBps']:.2f}"] if args.baseline else []) for r in res["attention"]],
    )
    print(text)
    if not args.skip_decode:
        res["decode"] = bench_decode(args)
        decode_text = table(
            ["model", "dtype", "threads", "context", "old ms/token", "new ms/token", "new tokens/s"],
            [[r["model"], r["dtype"], r["threads"], r["context"], r["old_ms"], r["new_ms"], r["new_tok_s"]]
             for r in res["decode"]],
        )
        print(decode_text)
        text += "\n\n" + decode_text
    write_json(out / "results.json", res)
    (out / "report.txt").write_text(text + "\n")
    print(f"wrote {out}/results.json and report.txt")


if __name__ == "__main__":
    main()
