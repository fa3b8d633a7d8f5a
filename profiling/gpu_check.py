"""One prepared run on a CUDA GPU (sized to fit one device command on an H200):

  (a) the kernel tests on CUDA (AGENTKV_KERNELS=auto, no interpreter);
  (b) paged attention against torch SDPA on pre-gathered contiguous K/V, for
      Δ in {1, 16, 128, 1024} new tokens over L in {1k, 8k, 32k} cached
      ones, batch 1 and 32, bf16, Llama-3-8B heads (32 q, 8 kv, d 128),
      page size 16, random block tables;
  (c) microbenchmarks of rope_and_store, rmsnorm, copy_pages, verify_drafts
      against their torch references;
  (d) decode ms per step on SmolLM2-135M's shape (bf16) at batch 1, 8 and 32,
      eager and under CUDA graphs (engine/decode_graphs.py), with the graphs
      captured and the Triton kernel variants compiled by each run;
  (e) the engine end to end: greedy tokens against the CPU path, then
      experiments.benchmarks.bench_session stateful vs stateless (run by
      name, in a process of its own).

Every section is guarded so one failure keeps the rest. Writes results.json
and results.md (plus the pytest log) to --out.

    bash profiling/gpu_check.sh --out runs/gpu_check
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout: gpu_check.sh runs its tests
# The interpreter must stay off for the benchmarks, and dispatch must follow the device.
os.environ.pop("TRITON_INTERPRET", None)
os.environ.pop("AGENTKV_KERNELS", None)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DEVICE = "cuda"
PEAK_TFLOPS = 790.0  # H200 dense bf16, as measured on random data
PEAK_GBPS = 4800.0  # H200 HBM3e datasheet
MEMORY_BUDGET = 60e9
QUANTILES = [0.5, 0.2, 0.8]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def guarded(results: dict, name: str, fn: Callable[[], object]) -> None:
    log(f"== {name}")
    start = time.time()
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()}
        log(f"{name} FAILED:\n{results[name]['error']}")
    log(f"== {name} done in {time.time() - start:.1f}s")


def bench(fn: Callable[[], object]) -> dict:
    import triton.testing

    median, p20, p80 = triton.testing.do_bench(fn, quantiles=QUANTILES)
    return {"ms": median, "ms_p20": p20, "ms_p80": p80}


# ---------------------------------------------------------------- (a) tests


def run_tests(out: Path, timeout_s: int) -> dict:
    tests = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/test_kernel_*.py")) + ["tests/test_decode_graphs.py"]
    cmd = [sys.executable, "-m", "pytest", *tests]
    cmd += ["-rfE", "-p", "no:cacheprovider", f"--junitxml={out / 'junit.xml'}"]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", "8"]  # compiling the test variants is the cost; spread it over cores
    log(" ".join(cmd))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        output, rc = output + f"\nTIMEOUT after {timeout_s}s", -1
    (out / "pytest.log").write_text(output)
    result = {"returncode": rc, "summary": output.strip().splitlines()[-1] if output.strip() else ""}
    result.update(_junit_counts(out / "junit.xml"))
    log(f"tests: {result}")
    return result


def _junit_counts(path: Path) -> dict:
    if not path.exists():
        return {"junit": "missing"}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed_tests"] = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ][:50]
    return counts


# ---------------------------------------------------- (b) paged attention


def attention_case(batch: int, delta: int, cached: int, heads=(32, 8), head_dim=128, page_size=16):
    """Paged inputs with random page permutations, and the same K/V gathered
    into contiguous [B, Hkv, S, D] tensors for SDPA."""
    from agentkv.kernels.metadata import AttnMetadata

    num_q_heads, num_kv_heads = heads
    seq_len = cached + delta
    pages_per_seq = math.ceil(seq_len / page_size)
    num_pages = batch * pages_per_seq
    dtype, dev = torch.bfloat16, DEVICE
    tables = torch.randperm(num_pages, device=dev).view(batch, pages_per_seq)
    meta = AttnMetadata.build([delta] * batch, [seq_len] * batch, tables.tolist(), page_size, device=dev)
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=dev)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch * delta, num_q_heads, head_dim, dtype=dtype, device=dev)

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        flat = cache[tables.long()].view(batch, pages_per_seq * page_size, num_kv_heads, head_dim)
        return flat[:, :seq_len].transpose(1, 2).contiguous()

    q_sdpa = q.view(batch, delta, num_q_heads, head_dim).transpose(1, 2).contiguous()
    return q, k_cache, v_cache, meta, q_sdpa, contiguous(k_cache), contiguous(v_cache)


def sdpa_fn(q, k, v, delta: int, scale: float, expand: bool) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(delta, k.shape[2]) if delta > 1 else None
    if expand:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def bench_attention_case(batch: int, delta: int, cached: int) -> dict:
    from agentkv.kernels.triton_paged_attention import _num_splits, _tile_sizes, paged_attention

    heads, head_dim = (32, 8), 128
    seq_len = cached + delta
    kv_bytes = batch * seq_len * heads[1] * head_dim * 2 * 2
    q_bytes = batch * delta * heads[0] * head_dim * 2
    # Paged cache, its contiguous copy, and up to 4x that if SDPA needs expanded GQA heads.
    need = kv_bytes * 6 + q_bytes * 6
    row = {"batch": batch, "delta": delta, "cached": cached}
    if need > MEMORY_BUDGET:
        return {**row, "skipped": f"needs ~{need / 1e9:.0f} GB"}
    q, k_cache, v_cache, meta, q_s, k_s, v_s = attention_case(batch, delta, cached)
    scale = head_dim**-0.5
    group = heads[0] // heads[1]
    block_q = _tile_sizes(group, delta, head_dim, 2)[0] // group
    row["num_splits"] = _num_splits(batch * math.ceil(delta / block_q) * heads[1], seq_len)

    ours = lambda: paged_attention(q, k_cache, v_cache, meta, scale)  # noqa: E731
    try:
        ref_fn, row["sdpa_gqa"] = sdpa_fn(q_s, k_s, v_s, delta, scale, expand=False), "native"
        expected = ref_fn()
    except RuntimeError:
        ref_fn, row["sdpa_gqa"] = sdpa_fn(q_s, k_s, v_s, delta, scale, expand=True), "expanded"
        expected = ref_fn()
    got = ours().view(batch, delta, heads[0], head_dim).transpose(1, 2)
    row["max_abs_err"] = (got.float() - expected.float()).abs().max().item()

    keys_seen = batch * (delta * cached + delta * (delta + 1) // 2)
    flops = 4 * heads[0] * head_dim * keys_seen
    bytes_moved = kv_bytes + 2 * q_bytes
    for name, fn in (("triton", ours), ("sdpa", ref_fn)):
        t = bench(fn)
        row[name] = {
            **t,
            "tflops": flops / t["ms"] / 1e9,
            "gbps": bytes_moved / t["ms"] / 1e6,
        }
        row[name]["pct_peak_flops"] = 100 * row[name]["tflops"] / PEAK_TFLOPS
        row[name]["pct_peak_bw"] = 100 * row[name]["gbps"] / PEAK_GBPS
    row["speedup_vs_sdpa"] = row["sdpa"]["ms"] / row["triton"]["ms"]
    del q, k_cache, v_cache, meta, q_s, k_s, v_s
    torch.cuda.empty_cache()
    return row


def run_attention() -> list[dict]:
    rows = []
    for batch in (1, 32):
        for cached in (1024, 8192, 32768):
            for delta in (1, 16, 128, 1024):
                try:
                    row = bench_attention_case(batch, delta, cached)
                except Exception:
                    row = {"batch": batch, "delta": delta, "cached": cached, "error": traceback.format_exc()}
                    torch.cuda.empty_cache()
                rows.append(row)
                log(f"attention {json.dumps(_brief(row))}")
    return rows


def _brief(row: dict) -> dict:
    keep = {k: v for k, v in row.items() if not isinstance(v, dict) and k != "error"}
    for name in ("triton", "sdpa"):
        if name in row:
            keep[name] = {k: round(v, 3) for k, v in row[name].items()}
    if "error" in row:
        keep["error"] = row["error"].strip().splitlines()[-1]
    return keep


# ------------------------------------------------------------ (c) micro


def run_micro() -> dict:
    results: dict[str, object] = {}
    for name, fn in (
        ("rope_and_store", micro_rope),
        ("rmsnorm", micro_rmsnorm),
        ("copy_pages", micro_copy_pages),
        ("verify_drafts", micro_verify),
    ):
        guarded(results, name, fn)
    return results


def _pair(ours: Callable, ref: Callable, bytes_moved: int) -> dict:
    t_ours, t_ref = bench(ours), bench(ref)
    return {
        "triton": {**t_ours, "gbps": bytes_moved / t_ours["ms"] / 1e6},
        "torch": {**t_ref, "gbps": bytes_moved / t_ref["ms"] / 1e6},
        "speedup": t_ref["ms"] / t_ours["ms"],
    }


def micro_rope() -> list[dict]:
    from agentkv.kernels import reference
    from agentkv.kernels.metadata import AttnMetadata
    from agentkv.kernels.triton_rope_and_store import rope_and_store

    rows = []
    hq, hkv, d, ps = 32, 8, 128, 16
    for tokens in (1, 32, 4096):
        batch = min(tokens, 32)
        q_len = tokens // batch
        pages = math.ceil((1000 + q_len) / ps)
        tables = torch.randperm(batch * pages).view(batch, pages).tolist()
        meta = AttnMetadata.build([q_len] * batch, [1000 + q_len] * batch, tables, ps, device=DEVICE)
        qkv = torch.randn(tokens, hq + 2 * hkv, d, dtype=torch.bfloat16, device=DEVICE)
        q, k, v = qkv.split([hq, hkv, hkv], dim=1)
        freqs = torch.outer(torch.arange(8192.0, device=DEVICE), torch.rand(d // 2, device=DEVICE))
        cos, sin = freqs.cos(), freqs.sin()
        k_cache = torch.zeros(batch * pages, ps, hkv, d, dtype=torch.bfloat16, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        moved = tokens * (hq + 2 * hkv) * d * 2 * 2 + tokens * d * 4
        row = _pair(
            lambda: rope_and_store(q, k, v, cos, sin, k_cache, v_cache, meta),
            lambda: reference.rope_and_store(q, k, v, cos, sin, k_cache, v_cache, meta),
            moved,
        )
        rows.append({"tokens": tokens, **row})
        log(f"rope_and_store T={tokens}: {row['triton']['ms'] * 1e3:.1f} us vs torch {row['torch']['ms'] * 1e3:.1f} us")
    return rows


def micro_rmsnorm() -> list[dict]:
    from agentkv.kernels import reference
    from agentkv.kernels.triton_rmsnorm import rmsnorm

    rows = []
    dim = 4096
    weight = torch.randn(dim, dtype=torch.bfloat16, device=DEVICE)
    for tokens in (32, 4096):
        x = torch.randn(tokens, dim, dtype=torch.bfloat16, device=DEVICE)
        res = torch.randn_like(x)
        moved = tokens * dim * 2 * 4 + dim * 2
        row = _pair(lambda: rmsnorm(x, weight, 1e-5, res), lambda: reference.rmsnorm(x, weight, 1e-5, res), moved)
        rows.append({"tokens": tokens, "dim": dim, **row})
        log(f"rmsnorm T={tokens}: {row['triton']['ms'] * 1e3:.1f} us vs torch {row['torch']['ms'] * 1e3:.1f} us")
    return rows


def micro_copy_pages() -> list[dict]:
    from agentkv.kernels import reference
    from agentkv.kernels.triton_copy_pages import copy_pages

    rows = []
    layers, pages, ps, hkv, d = 32, 1024, 16, 8, 128
    kv = torch.zeros(layers, 2, pages, ps, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    for copies in (1, 64):
        perm = torch.randperm(pages, device=DEVICE)
        src, dst = perm[:copies], perm[copies : 2 * copies]
        moved = 2 * copies * layers * 2 * ps * hkv * d * 2
        row = _pair(lambda: copy_pages(kv, src, dst), lambda: reference.copy_pages(kv, src, dst), moved)
        rows.append({"copies": copies, "layers": layers, **row})
        log(f"copy_pages n={copies}: {row['triton']['ms'] * 1e3:.1f} us vs torch {row['torch']['ms'] * 1e3:.1f} us")
    return rows


def micro_verify() -> list[dict]:
    from agentkv.kernels import reference
    from agentkv.kernels.triton_verify_drafts import verify_drafts

    rows = []
    vocab, k = 128256, 8
    for batch in (1, 32):
        rows_total = batch * (k + 1)
        logits = torch.randn(rows_total, vocab, device=DEVICE)
        cu_rows = torch.arange(0, rows_total + 1, k + 1, dtype=torch.int32, device=DEVICE)
        lens = torch.full((batch,), k, dtype=torch.int32, device=DEVICE)
        # Drafts that all match: the worst case, every row read.
        drafts = logits.argmax(-1).view(batch, k + 1)[:, :k].contiguous()
        # Peaked rows, so sampling accepts some drafts too.
        probs = torch.softmax(8 * logits, -1)
        uniforms = torch.rand(batch, k + 1, device=DEVICE)
        moved = rows_total * vocab * 4
        for mode, target, u in (("greedy", logits, None), ("sampling", probs, uniforms)):
            row = _pair(
                lambda: verify_drafts(target, cu_rows, drafts, lens, u),
                lambda: reference.verify_drafts(target, cu_rows, drafts, lens, u),
                moved,
            )
            got = verify_drafts(target, cu_rows, drafts, lens, u)
            want = reference.verify_drafts(target, cu_rows, drafts, lens, u)
            row["matches_reference"] = all(torch.equal(a, b) for a, b in zip(got, want))
            row["mean_accepted"] = got[0].float().mean().item()
            rows.append({"batch": batch, "k": k, "vocab": vocab, "mode": mode, **row})
            log(f"verify_drafts B={batch} {mode}: {row['triton']['ms'] * 1e3:.1f} us vs torch {row['torch']['ms'] * 1e3:.1f} us")
    return rows


# ------------------------------------------------------------ report


# ---------------------------------------------------------------- (d) engine


def run_engine(out: Path) -> dict:
    """The engine end to end on CUDA (Triton path): the same greedy tokens as
    the CPU torch path on the same fp32 weights, then the 12-turn stateful vs
    stateless benchmark on SmolLM2-135M's shape in bf16."""
    from agentkv import Engine
    from agentkv.experiments.common import random_model

    tokens = {}
    for device in ("cpu", "cuda"):
        engine = Engine(random_model("tiny", torch.float32, seed=5, device=device), None, page_size=16, num_pages=64)
        with engine.session() as s:
            s.append(list(range(3, 300)))
            out_ids = s.generate(max_tokens=24, ignore_eos=True, speculative=False)
            s.append(list(range(40, 90)))
            out_ids += s.generate(max_tokens=24, ignore_eos=True, speculative=True)
        tokens[device] = out_ids
    result = {"greedy_tokens_identical": tokens["cpu"] == tokens["cuda"], "tokens": tokens}
    log(f"engine: tokens identical cpu/cuda: {result['greedy_tokens_identical']}")
    # A benchmark, started by name as its own process (profiling imports none);
    # the memory this one has cached goes back first.
    torch.cuda.empty_cache()
    cmd = [sys.executable, "-m", "agentkv.experiments.benchmarks.bench_session",
           "--device", "cuda", "--dtype", "bfloat16", "--repeats", "2", "--kv-gb", "4"]
    report = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
    (out / "bench_session.txt").write_text(report)
    result["bench_session"] = report
    log(report)
    return result


def compiled_variants() -> int | None:
    """Kernel variants Triton has compiled so far in this process, over the
    kernels of kernels/triton_*.py (None where this Triton keeps them where
    this does not look)."""
    import pkgutil

    import triton
    from agentkv import kernels

    total = 0
    for info in pkgutil.iter_modules(kernels.__path__):
        if not info.name.startswith("triton_"):
            continue
        module = importlib.import_module(f"agentkv.kernels.{info.name}")
        for fn in vars(module).values():
            if not isinstance(fn, triton.runtime.jit.JITFunction):
                continue
            caches = getattr(fn, "device_caches", None)  # triton >= 3.2: device -> (kernels, ...)
            if caches is not None:
                total += sum(len(entry[0]) for entry in caches.values())
            elif isinstance(getattr(fn, "cache", None), dict):
                total += sum(len(v) for v in fn.cache.values())
            else:
                return None
    return total


def decode_rows(device: str = DEVICE, shape: str = "smollm2-135m", dtype=None, batches=(1, 8, 32),
                prompt_len: int = 1024, steps: int = 64) -> list[dict]:
    """Decode ms per step (one token for every sequence) after a prompt of
    prompt_len tokens each, eager and with decode graphs, non-speculative."""
    from agentkv import Engine
    from agentkv.experiments.common import random_model

    dtype = dtype or torch.bfloat16
    model = random_model(shape, dtype, seed=0, device=device)
    rows = []
    for graphs in (False, True):
        for batch in batches:
            before = compiled_variants() if device == "cuda" else None
            engine = Engine(model, None, page_size=16, kv_cache_bytes=4 << 30, prefix_cache=False,
                            decode_graphs=graphs)
            sessions = [engine.session() for _ in range(batch)]
            for i, s in enumerate(sessions):
                s.append([(7 * i + j) % 1000 + 3 for j in range(prompt_len)])
            timed = []
            for _ in range(2):  # the first round compiles and captures
                reqs = [s.start_generate(max_tokens=steps, ignore_eos=True, speculative=False) for s in sessions]
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for r in reqs:
                    engine.scheduler.wait(r)
                if device == "cuda":
                    torch.cuda.synchronize()
                timed.append((time.perf_counter() - start) * 1e3 / steps)
            g = engine.runner.graphs
            after = compiled_variants() if device == "cuda" else None
            rows.append({
                "graphs": graphs, "batch": batch, "ms_per_step_first": timed[0], "ms_per_step": timed[1],
                "tokens_per_s": batch * 1e3 / timed[1], "graphs_captured": g.captures if g else 0,
                "graph_replays": g.replays if g else 0,
                "triton_variants_compiled": None if before is None or after is None else after - before,
            })
            log(f"decode: {rows[-1]}")
            for s in sessions:
                s.close()
    return rows


def markdown(results: dict) -> str:
    lines = [f"# GPU check ({results.get('device', '?')})", ""]
    tests = results.get("tests", {})
    if "error" in tests:
        lines += ["## Tests", "", "```", tests["error"], "```", ""]
    else:
        lines += [
            "## Tests",
            "",
            f"passed {tests.get('passed')}, failed {tests.get('failures')}, skipped {tests.get('skipped')}, "
            f"errors {tests.get('errors')} (rc {tests.get('returncode')}): {tests.get('summary')}",
            "",
            *[f"- {f}" for f in tests.get("failed_tests", [])],
            "",
        ]
    lines += [
        "## Paged attention vs SDPA (bf16, 32/8 heads, d 128, page 16)",
        "",
        "| B | Δ | L cached | splits | triton ms | TFLOP/s | GB/s | %peak FLOP | %peak BW | sdpa ms | sdpa TFLOP/s | sdpa GB/s | speedup | max err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    attention = results.get("attention")
    if isinstance(attention, dict):
        lines += ["", "```", attention.get("error", ""), "```"]
    for r in attention or []:
        head = f"| {r['batch']} | {r['delta']} | {r['cached']} |"
        if "triton" not in r:
            reason = r.get("skipped") or r.get("error", "").strip().splitlines()[-1]
            lines.append(f"{head} {reason} |" + " |" * 10)
            continue
        t, s = r["triton"], r["sdpa"]
        lines.append(
            f"{head} {r['num_splits']} | {t['ms']:.3f} | {t['tflops']:.1f} | {t['gbps']:.0f} | {t['pct_peak_flops']:.1f} | "
            f"{t['pct_peak_bw']:.1f} | {s['ms']:.3f} | {s['tflops']:.1f} | {s['gbps']:.0f} | {r['speedup_vs_sdpa']:.2f} | "
            f"{r['max_abs_err']:.2e} |"
        )
    lines += ["", "## Microbenchmarks (triton vs torch reference)", "", "| op | case | triton us | GB/s | torch us | speedup |", "|---|---|---|---|---|---|"]
    for op, rows in (results.get("micro") or {}).items():
        if isinstance(rows, dict):
            lines.append(f"| {op} | error: {rows.get('error', '').strip().splitlines()[-1]} | | | | |")
            continue
        for r in rows:
            case = ", ".join(f"{k}={v}" for k, v in r.items() if not isinstance(v, dict) and k != "speedup")
            lines.append(
                f"| {op} | {case} | {r['triton']['ms'] * 1e3:.1f} | {r['triton']['gbps']:.0f} | "
                f"{r['torch']['ms'] * 1e3:.1f} | {r['speedup']:.2f} |"
            )
    decode = results.get("decode")
    if decode:
        lines += ["", "## Decode (SmolLM2-135M shape, bf16, 1k-token prompts, 64 steps, second run)", ""]
        if isinstance(decode, dict):
            lines += ["```", str(decode.get("error")), "```"]
        else:
            lines += ["| graphs | batch | ms/step | first run ms/step | tok/s | graphs captured | replays | "
                      "Triton variants compiled |", "|---|---|---|---|---|---|---|---|"]
            lines += [f"| {r['graphs']} | {r['batch']} | {r['ms_per_step']:.2f} | {r['ms_per_step_first']:.2f} | "
                      f"{r['tokens_per_s']:.0f} | {r['graphs_captured']} | {r['graph_replays']} | "
                      f"{r['triton_variants_compiled']} |" for r in decode]
    engine = results.get("engine", {})
    if engine:
        lines += ["", "## Engine on CUDA", ""]
        if "error" in engine:
            lines += ["```", str(engine["error"]), "```"]
        else:
            lines += [f"greedy tokens identical to the CPU torch path: {engine['greedy_tokens_identical']}", "",
                      "```", engine["bench_session"].strip(), "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu_check")
    parser.add_argument("--test-timeout", type=int, default=240)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA device")
    import triton

    results: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
    }
    log(f"{results}")

    def save() -> None:
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "results.md").write_text(markdown(results))

    guarded(results, "tests", lambda: run_tests(out, args.test_timeout))
    save()
    guarded(results, "attention", run_attention)
    save()
    guarded(results, "micro", run_micro)
    save()
    guarded(results, "decode", decode_rows)
    save()
    guarded(results, "engine", lambda: run_engine(out))
    save()
    log(f"wrote {out / 'results.json'} and {out / 'results.md'}")


if __name__ == "__main__":
    main()
