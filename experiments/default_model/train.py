"""Train the project's own small agent model on generated tool-calling transcripts.

    python -m agentkv.experiments.default_model.train --out DIR --minutes M [--device cuda] [--shape agent-25m] [--resume CKPT]

The model is model.llama.Transformer (the architecture the engine serves, one
definition), trained through model/dense_forward.py (a dense causal forward
over a padded batch on the same modules and weights), over the project's
default byte-level BPE tokenizer, from scratch, on data made on the fly by
experiments/default_model/data.py: windows of multi-agent transcripts from
experiments/workloads/workflows.py with directed tool-call turns, short task episodes
from experiments/default_model/tasks.py (plainly worded requests, final answers,
no-tool and plain-text turns, long-context copies, hand-offs), packed into
rows of --seq-len tokens, plus dense synthetic copy documents that are mixed
in heavily at first (until copying has formed, i.e. their accuracy is high)
and then annealed. Tool names and argument names are split by hash: held-out
names never reach a training batch, and the periodic evaluation measures
held-out turns only.

The run is boxed by wall-clock time (--minutes, counted from the start of the
process): the loop stops when the next step would cross the deadline (or on
SIGINT/SIGTERM), then evaluates and exits. Each periodic evaluation
(teacher-forced, batched) that beats every earlier one on held-out exact
arguments exports the model: --out always holds the best checkpoint seen.

Outputs (flat in --out): config.json, the weights in bf16 (model.safetensors,
or model-0000k-of-0000n.safetensors shards of at most 15 MB with
model.safetensors.index.json), tokenizer.json, tokenizer_config.json (with
the chat template), generation_config.json -- a Hugging Face checkpoint that
our loader and transformers both read -- plus train_log.json (config,
held-out split, progress, evaluations, which step was kept) and loss.png
(matplotlib). A resumable checkpoint of the latest weights with the optimizer
state goes to --ckpt (outside --out) every --ckpt-every seconds.

Choices:
- Loss on every token, weighted: assistant replies 1.0, synthetic copy
  targets 1.0, everything else (system prompt, schemas, tool results,
  directives) 0.25. The context still teaches copying (results echo the
  arguments, directives restate values seen earlier) and the schema format,
  but most of it is freshly minted random ids no model can predict; at full
  weight that noise would drown the replies, which are 3-5% of the tokens.
- Curriculum by measurement, not by step count: synthetic rows make up
  --p-syn-start of the batches until their copy accuracy reaches --copy-acc
  (copying has formed) or --warmup-max-frac of the budget has passed, then
  anneal to --p-syn-end over --anneal-frac; short synthetic documents also
  fill the tail of every packed row.
- LR: linear warm-up, constant, then linear decay over the last --decay-frac
  of the time budget (the schedule follows the clock, since the budget is
  wall time).
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

T0 = time.monotonic()  # the wall-clock budget counts from here
# The tokenizer is trained (with Rayon threads) before data workers fork.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from agentkv.experiments.default_model import data as D  # noqa: E402
from agentkv.experiments.default_model.tokenizer import build_default_tokenizer  # noqa: E402
from agentkv.experiments.report import pyplot  # noqa: E402
from agentkv.model.config import ModelConfig  # noqa: E402
from agentkv.model.dense_forward import dense_hidden, dense_logits, trainable_parameters  # noqa: E402
from agentkv.model.llama import Transformer  # noqa: E402
from agentkv.model.loader import hf_tensors, load_model  # noqa: E402
from agentkv.model.tokenizer import Tokenizer  # noqa: E402

# Model shapes (HF LlamaConfig fields). agent-8m: 7.6M parameters, 15.2 MB in
# bf16, GQA 3:1, head_dim 64 (the shipped default). agent-25m: 8 layers, hidden
# 512, 24.6M parameters, 49 MB in bf16 as 4 shards of at most 15 MB (files come
# back from the GPU machine at most 16 MB each, at most 8 of them).
SHAPES = {
    "agent-25m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64),
    "agent-8m": dict(hidden_size=384, intermediate_size=704, num_hidden_layers=5, num_attention_heads=6,
                     num_key_value_heads=2, head_dim=64),
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32),
}
MAX_POSITIONS = 16384
ROPE_THETA = 10000.0
RMS_EPS = 1e-6
LOSS_WEIGHTS = {D.NO_LOSS: 0.0, D.CONTEXT: 0.25, D.ASSISTANT: 1.0, D.SYNTH: 1.0}
# Issue 22's targets on held-out calls (experiments/default_model/eval.py has them all);
# teacher-forced exactness equals greedy for the tool and the arguments.
TARGETS = {"right_tool": 0.95, "exact_args": 0.80}


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------
# The model: model.llama.Transformer, trained through model/dense_forward.py


def hf_config(shape: dict, vocab_size: int, eos: int, pad: int, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        **shape, "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": RMS_EPS, "rope_theta": ROPE_THETA,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": None, "eos_token_id": eos, "pad_token_id": pad, "torch_dtype": dtype,
    }


def build_model(cfg: dict, seed: int, device: torch.device | str = "cpu") -> Transformer:
    """The project's Transformer for an HF config, fp32, randomly initialised
    (normal 0.02; the projections into the residual stream scaled down by
    depth, as GPT-2), with its trainable parameters unfrozen."""
    model = Transformer(ModelConfig.from_hf(cfg), torch.float32, device)
    g = torch.Generator().manual_seed(seed)
    scaled = 0.02 / math.sqrt(2 * cfg["num_hidden_layers"])
    with torch.no_grad():
        for name, p in trainable_parameters(model).items():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                std = scaled if name.endswith(("o_weight", "down_weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g).to(p.device) * std)
    return model


SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MAX_SHARD_BYTES = 15 * 10**6  # files come back from the GPU machine at most 16 MB each


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def export_hf(model: Transformer, out: Path, tok: Tokenizer, shape: dict, dtype: str = "bfloat16",
              max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write config.json, the weights (model.safetensors, or shards of at most
    max_shard_bytes with model.safetensors.index.json) and
    generation_config.json; the tokenizer files are written once, at start.
    Each file is replaced atomically and the index last, so a kill mid-save
    leaves a readable export. Returns the weight files' names."""
    from huggingface_hub import save_torch_state_dict

    out.mkdir(parents=True, exist_ok=True)
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    cfg = hf_config(shape, model.cfg.vocab_size, eos, pad, dtype)
    gen = {"bos_token_id": None, "eos_token_id": [eos, pad], "pad_token_id": pad, "do_sample": False}
    stage = out / ".export"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    save_torch_state_dict(hf_tensors(model, SAVE_DTYPES[dtype]), stage, max_shard_size=max_shard_bytes,
                          metadata={"format": "pt"})
    files = sorted(p.name for p in stage.iterdir())
    index = "model.safetensors.index.json"
    for name in [f for f in files if f != index] + [f for f in files if f == index]:
        os.chmod(stage / name, 0o644)
        os.replace(stage / name, out / name)
    stage.rmdir()
    for old in out.glob("model*.safetensors*"):  # a previous export of another layout
        if old.name not in files:
            old.unlink()
    _atomic_write(out / "config.json", (json.dumps(cfg, indent=2) + "\n").encode())
    _atomic_write(out / "generation_config.json", (json.dumps(gen, indent=2) + "\n").encode())
    return [f for f in files if f != index]


def load_hf_weights(model: Transformer, path: Path) -> None:
    """Weights of an HF checkpoint (through our loader) into a model of its shape."""
    src = dict(load_model(path, "float32").named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(src[name].to(p.device))


def param_count(model: Transformer) -> int:
    return sum(p.numel() for p in trainable_parameters(model).values())


# ---------------------------------------------------------------------------
# Data: worker processes fill a queue with packed rows


def _worker(wid: int, seed: int, seq_len: int, tok_dir: str, split_json: dict, p_syn, out: mp.Queue,
            stop, parent: int) -> None:
    # Workers never touch torch. They leave when told, or when the trainer is gone
    # (a SIGKILLed trainer must not leave them running, holding the terminal).
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        out.cancel_join_thread()  # exit without flushing rows nobody will read
        tok = Tokenizer.from_dir(tok_dir)
        maker = D.RowMaker(tok, seq_len, seed, D.Split.from_json(split_json))
        while not stop.is_set() and os.getppid() == parent:
            ids, codes = maker.row(p_syn.value)
            while not stop.is_set() and os.getppid() == parent:
                try:
                    out.put((ids.astype(np.int16), codes), timeout=0.5)
                    break
                except queue.Full:
                    continue
    except Exception:
        try:
            out.put(("error", wid, traceback.format_exc()), timeout=5)
        except Exception:
            pass


class RowSource:
    """Rows for batches: fresh ones from the workers; when none is ready, a
    random recent one again (data echoing) rather than an idle accelerator."""

    def __init__(self, tok_dir: Path, seq_len: int, seed: int, split: D.Split, workers: int, p_syn: float):
        self.seq_len = seq_len
        self.fresh: collections.deque = collections.deque()
        self.seen: list = []
        self.seen_max = 2048
        self.n_fresh = self.n_echo = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._split = split
        self._seed = seed
        self._tok_dir = tok_dir
        self.workers = []
        self.p_syn_value = p_syn
        self.local: D.RowMaker | None = None
        if workers > 0:
            ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
            self.queue = ctx.Queue(maxsize=max(64, 8 * workers))
            self.p_syn = ctx.Value("d", p_syn, lock=False)
            self.stop = ctx.Event()
            for wid in range(workers):
                p = ctx.Process(target=_worker, daemon=True, args=(
                    wid, seed * 1000 + wid, seq_len, str(tok_dir), split.as_json(), self.p_syn, self.queue, self.stop,
                    os.getpid()))
                p.start()
                self.workers.append(p)
            self._thread = threading.Thread(target=self._pump, daemon=True)
            self._running = True
            self._thread.start()
        else:
            self.queue = None

    def set_p_syn(self, p: float) -> None:
        self.p_syn_value = p
        if self.workers:
            self.p_syn.value = p

    def _pump(self) -> None:
        while self._running:
            try:
                item = self.queue.get(timeout=0.5)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            if isinstance(item[0], str):
                self.errors.append(f"worker {item[1]}: {item[2]}")
                log(f"data worker {item[1]} failed:\n{item[2]}")
                continue
            with self._lock:
                self.fresh.append(item)
                while len(self.fresh) > 512:  # the trainer is slower than the workers: keep them current
                    self.fresh.popleft()

    def _local_row(self):
        if self.local is None:
            tok = Tokenizer.from_dir(self._tok_dir)
            self.local = D.RowMaker(tok, self.seq_len, self._seed * 1000 + 999, self._split)
        ids, codes = self.local.row(self.p_syn_value)
        return ids.astype(np.int16), codes

    def take(self, n: int, wait_s: float = 60.0) -> tuple[np.ndarray, np.ndarray]:
        rows = []
        deadline = time.monotonic() + wait_s
        while len(rows) < n:
            item = None
            with self._lock:
                if self.fresh:
                    item = self.fresh.popleft()
            if item is not None:
                self.n_fresh += 1
                self.seen.append(item)
                if len(self.seen) > self.seen_max:
                    self.seen[random.randrange(self.seen_max)] = self.seen.pop()
                rows.append(item)
                continue
            alive = any(p.is_alive() for p in self.workers)
            if self.seen and alive and len(self.seen) >= 4 * n:
                self.n_echo += 1
                rows.append(random.choice(self.seen))
                continue
            if not alive or time.monotonic() > deadline:
                item = self._local_row()  # no workers (or they are stuck): make it here
                self.n_fresh += 1
                self.seen.append(item)
                rows.append(item)
                continue
            time.sleep(0.005)
        ids = np.stack([r[0] for r in rows]).astype(np.int64)
        codes = np.stack([r[1] for r in rows])
        return ids, codes

    def close(self) -> None:
        if self.workers:
            self._running = False
            self.stop.set()
            deadline = time.monotonic() + 3.0
            for p in self.workers:
                p.join(timeout=max(0.01, deadline - time.monotonic()))
            for p in self.workers:
                if p.is_alive():
                    p.kill()
            self.queue.cancel_join_thread()


# ---------------------------------------------------------------------------
# Teacher-forced held-out evaluation (fast, batched; exact for greedy)


class TFEval:
    """Held-out turns scored in one batched forward: a greedy decoder writes the
    right tool name iff every reply token up to the name's closing quote is the
    argmax, and the whole call iff every reply token (and <|im_end|>) is. For a
    turn whose reference is a text answer, "exact" is the whole answer,
    "right_tool" its first token, and "begun_as_answer" whether the first
    token is anything but a call's (the decision to answer, whatever the
    words)."""

    def __init__(self, tok: Tokenizer, turns: list[D.EvalTurn]):
        r = D.Renderer(tok)
        self.items = []
        im_end = tok.token_to_id("<|im_end|>")
        self.call_start = tok.backend.encode("<tool_call>", add_special_tokens=False).ids[0]
        for t in turns:
            prompt = tok.encode(r.render(t.messages, t.tools or None, True))
            enc = tok.backend.encode(t.reply_text, add_special_tokens=False)
            reply = list(enc.ids) + [im_end]
            n_name = 1
            if t.reference:
                name = t.reference[0]["name"]
                quote = t.reply_text.index(f'"name": "{name}"') + len(f'"name": "{name}')
                n_name = next(i for i, (s, e) in enumerate(enc.offsets) if e > quote) + 1
            group = "calls" if t.reference else "answers"
            self.items.append((prompt, reply, n_name, group, t.source, t.heldout_args > 0))

    @torch.no_grad()
    def run(self, model: Transformer, device: torch.device, autocast, max_tokens: int = 65536) -> dict:
        model.eval()
        order = sorted(range(len(self.items)), key=lambda i: len(self.items[i][0]) + len(self.items[i][1]))
        results = {}
        batch: list[int] = []

        def flush(batch: list[int]) -> None:
            seqs = [self.items[i][0] + self.items[i][1] for i in batch]
            width = max(map(len, seqs))
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            for row, s in enumerate(seqs):
                ids[row, : len(s)] = torch.tensor(s)
            with autocast():
                h = dense_hidden(model, ids.to(device))
            for row, i in enumerate(batch):
                prompt, reply, n_name = self.items[i][:3]
                pos = torch.arange(len(prompt) - 1, len(prompt) + len(reply) - 1, device=device)
                with autocast():
                    pred = dense_logits(model, h[row, pos]).float().argmax(-1).cpu()
                ok = (pred == torch.tensor(reply)).tolist()
                results[i] = (all(ok[:n_name]), all(ok), sum(ok) / len(ok), int(pred[0]) != self.call_start)

        for i in order:
            n = len(self.items[i][0]) + len(self.items[i][1])
            if batch and (len(batch) + 1) * n > max_tokens:
                flush(batch)
                batch = []
            batch.append(i)
        if batch:
            flush(batch)
        model.train()
        out = {"turns": len(self.items)}
        groups = {"all": lambda it: it[3] == "calls", "workflow": lambda it: it[3] == "calls" and it[4] == "workflow",
                  "task calls": lambda it: it[3] == "calls" and it[4] == "task",
                  "held-out args": lambda it: it[3] == "calls" and it[5], "answers": lambda it: it[3] == "answers"}
        for name, pick in groups.items():
            keys = [i for i in results if pick(self.items[i])]
            if keys:
                out[name] = {"right_tool": sum(results[i][0] for i in keys) / len(keys),
                             "exact_args": sum(results[i][1] for i in keys) / len(keys),
                             "token_acc": sum(results[i][2] for i in keys) / len(keys), "n": len(keys)}
                if name == "answers":
                    out[name]["begun_as_answer"] = sum(results[i][3] for i in keys) / len(keys)
        return out


# ---------------------------------------------------------------------------
# Loss curve


def plot(path: Path, history: list[dict], evals: list[dict]) -> None:
    series = {}
    for key in ("loss", "loss_assistant", "loss_context", "loss_synthetic"):
        pts = [(r["tokens"] / 1e6, r[key]) for r in history if r.get(key) is not None]
        if pts:
            series[key] = ([p[0] for p in pts], [p[1] for p in pts])
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, (xs, ys) in series.items():
        axes[0].plot(xs, ys, label=key)
    axes[0].set_xlabel("training tokens (M)")
    axes[0].set_ylabel("cross-entropy (nats/token)")
    axes[0].set_yscale("log")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend()
    axes[0].grid(alpha=0.3)
    for group in ("all", "answers"):
        for key in ("right_tool", "exact_args", "token_acc"):
            pts = [(e["tokens"] / 1e6, e[group][key]) for e in evals if key in e.get(group, {})]
            if pts:
                axes[1].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"held-out {group} {key} (TF)")
    axes[1].set_xlabel("training tokens (M)")
    axes[1].set_ylim(0, 1.02)
    if axes[1].get_legend_handles_labels()[0]:
        axes[1].legend(fontsize=8)
    axes[1].grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# Training


class Stopper:
    """SIGINT/SIGTERM end the loop at the next step boundary; a second one exits."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log(f"signal {signum}: stopping after this step")


def lr_at(step: int, frac: float, args) -> float:
    warm = min(1.0, (step + 1) / args.warmup_steps)
    decay_start = 1.0 - args.decay_frac
    if frac <= decay_start:
        return args.lr * warm
    k = min(1.0, (frac - decay_start) / max(args.decay_frac, 1e-9))
    return args.lr * warm * (1.0 - k * (1.0 - args.final_lr_frac))


def tokenizer_dir(args, out: Path) -> Path:
    if args.tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(Path(args.tokenizer) / name, out / name)
    else:
        build_default_tokenizer(out)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (flat: HF checkpoint, train_log.json, loss.png)")
    p.add_argument("--minutes", type=float, required=True, help="wall-clock budget from process start")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--resume", help="a .pt checkpoint (weights, optimizer, progress) or an HF model folder (weights)")
    p.add_argument("--ckpt", help="resumable checkpoint path (default: beside --out, <out>.resume.pt)")
    p.add_argument("--shape", default="agent-8m", choices=sorted(SHAPES))
    p.add_argument("--seq-len", type=int, default=None, help="row length (default 8192 on CUDA, 1024 on CPU)")
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per step (default 65536 CUDA, 8192 CPU)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=250)
    p.add_argument("--decay-frac", type=float, default=0.2, help="last fraction of the budget: LR decays linearly")
    p.add_argument("--final-lr-frac", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--p-syn-start", type=float, default=0.5, help="share of synthetic copy rows during warm-up")
    p.add_argument("--p-syn-end", type=float, default=0.08, help="share after the anneal")
    p.add_argument("--copy-acc", type=float, default=0.7, help="synthetic copy accuracy that ends the warm-up")
    p.add_argument("--warmup-max-frac", type=float, default=0.3, help="warm-up ends by this fraction of the budget")
    p.add_argument("--anneal-frac", type=float, default=0.15, help="fraction of the budget to anneal over")
    p.add_argument("--workers", type=int, default=None, help="data worker processes (default: cores - 2, max 14)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--eval-turns", type=int, default=48, help="held-out workflow turns of the periodic eval")
    p.add_argument("--eval-task-turns", type=int, default=sum(D.TASK_EVAL_COUNTS.values()),
                   help="held-out task-episode turns of the periodic eval (spread over their kinds)")
    p.add_argument("--eval-every", type=float, default=None, help="seconds between held-out evaluations")
    p.add_argument("--ckpt-every", type=float, default=60.0, help="seconds between exports/checkpoints")
    p.add_argument("--log-every", type=float, default=None, help="seconds between progress lines")
    p.add_argument("--stop-at-targets", action="store_true",
                   help="stop once two evaluations in a row meet TARGETS")
    p.add_argument("--save-dtype", default="bfloat16", choices=sorted(SAVE_DTYPES))
    p.add_argument("--max-shard-mb", type=float, default=MAX_SHARD_BYTES / 1e6, help="largest weight file (MB)")
    p.add_argument("--tokenizer", help="copy tokenizer.json/tokenizer_config.json from here instead of building")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (falls back to eager on failure)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-wandb", action="store_true")
    p.add_argument("--final-reserve", type=float, default=None, help="seconds kept for the final eval and save")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = T0 + args.minutes * 60.0
    stopper = Stopper()
    dev_name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev_name.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        log("CUDA requested but not available: using the CPU")
        dev_name, cuda = "cpu", False
    seq_len = args.seq_len or (8192 if cuda else 1024)
    batch_tokens = args.batch_tokens or (65536 if cuda else 8192)
    rows_per_batch = max(1, batch_tokens // seq_len)
    eval_every = args.eval_every or (45.0 if cuda else 30.0)
    log_every = args.log_every or (15.0 if cuda else 10.0)
    reserve = args.final_reserve if args.final_reserve is not None else min(20.0, 0.05 * args.minutes * 60)
    if args.threads:
        torch.set_num_threads(args.threads)
    elif cuda:
        torch.set_num_threads(2)  # the cores belong to the data workers
    workers = args.workers if args.workers is not None else max(1, min(14, (os.cpu_count() or 2) - 2))
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = Path(args.ckpt) if args.ckpt else out.with_name(out.name + ".resume.pt")
    tok_dir = tokenizer_dir(args, out)
    tok = Tokenizer.from_dir(tok_dir)
    tok_md5 = hashlib.md5((tok_dir / "tokenizer.json").read_bytes()).hexdigest()
    split = D.default_split()
    log(f"device {dev_name}, seq_len {seq_len}, {rows_per_batch} rows/step, {workers} data workers; "
        f"held out: {len(split.tool_cores)} tool cores ({len(split.tools)} names), {len(split.args)} argument names")

    # Workers fork before CUDA is touched.
    source = RowSource(tok_dir, seq_len, args.seed, split, workers, args.p_syn_start)
    try:
        return _train(args, out, ckpt_path, tok, tok_md5, split, source, dev_name, cuda, seq_len, rows_per_batch,
                      eval_every, log_every, reserve, deadline, stopper)
    finally:
        source.close()


def _train(args, out, ckpt_path, tok, tok_md5, split, source, dev_name, cuda, seq_len, rows_per_batch, eval_every,
           log_every, reserve, deadline, stopper) -> int:
    device = torch.device(dev_name)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    shape = dict(SHAPES[args.shape])
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    model = build_model(hf_config(shape, tok.vocab_size, eos, pad, args.save_dtype), args.seed)
    state = {"step": 0, "tokens": 0, "history": [], "evals": [], "train_s": 0.0, "phase": "warmup",
             "anneal_start": None, "copy_acc": 0.0}
    opt_state = None
    if args.resume:
        path = Path(args.resume)
        if path.is_dir():
            load_hf_weights(model, path)
            log(f"resumed weights from {path} (fresh optimizer)")
        else:
            ck = torch.load(path, map_location="cpu", weights_only=False)
            if ck["shape"] != shape:
                raise SystemExit(f"--resume {path} has shape {ck['shape']}, not {args.shape}")
            model.load_state_dict(ck["model"])
            opt_state = ck["optimizer"]
            state.update(ck["state"])
            if state["phase"] != "warmup":
                state["phase"] = "done"
            log(f"resumed {path}: step {state['step']}, {state['tokens'] / 1e6:.1f}M tokens")
    model.to(device)
    params = trainable_parameters(model)  # .to() made new tensors: unfreeze those
    n_params = param_count(model)
    log(f"model {args.shape}: {n_params / 1e6:.2f}M parameters ({n_params * 2 / 1e6:.1f} MB in bf16)")

    decay, no_decay = [], []
    for name, p in params.items():
        (decay if p.dim() == 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if cuda else {}))
    if opt_state is not None:
        opt.load_state_dict(opt_state)

    if cuda:
        def autocast():
            return torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        import contextlib

        def autocast():
            return contextlib.nullcontext()

    def eager(ids: torch.Tensor) -> torch.Tensor:
        return dense_logits(model, dense_hidden(model, ids))

    fwd = eager
    if args.compile:
        try:
            fwd = torch.compile(eager)
        except Exception as e:
            log(f"torch.compile unavailable ({e}); eager")
            fwd = eager

    renderer = D.Renderer(tok)
    eval_turns = D.eval_turns(args.eval_turns, renderer, seq_len, split)
    total = sum(D.TASK_EVAL_COUNTS.values())
    counts = {k: max(1, round(v * args.eval_task_turns / total)) for k, v in D.TASK_EVAL_COUNTS.items()}
    eval_turns += D.task_eval_turns(renderer, seq_len, split, counts) if args.eval_task_turns else []
    tf_eval = TFEval(tok, eval_turns)
    log(f"held-out eval: {len(eval_turns)} turns ({sum(t.source == 'task' for t in eval_turns)} task episodes, "
        f"{sum(not t.reference for t in eval_turns)} answers), "
        f"{sum(t.heldout_args > 0 for t in eval_turns)} with held-out argument names")

    wandb_run = None
    if not args.no_wandb:
        try:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            wandb_dir = Path(os.environ.get("WANDB_DIR", "runs"))
            wandb_dir.mkdir(parents=True, exist_ok=True)
            wandb_run = wandb.init(project="agentkv", name=f"train-agent-{out.name}", mode="offline",
                                   dir=str(wandb_dir), config={**vars(args), "params": n_params, "seq_len": seq_len})
        except Exception as e:
            log(f"wandb off ({type(e).__name__})")
            wandb_run = None

    weights = torch.tensor([LOSS_WEIGHTS[c] for c in range(4)], device=device)
    meta = {
        "argv": sys.argv, "args": vars(args), "shape": args.shape, "hf_shape": shape, "params": n_params,
        "seq_len": seq_len, "rows_per_batch": rows_per_batch, "device": dev_name,
        "gpu": torch.cuda.get_device_name(0) if cuda else None, "torch": torch.__version__,
        "python": sys.version.split()[0], "tokenizer_md5": tok_md5, "loss_weights": LOSS_WEIGHTS,
        "split": split.as_json(), "eval_turns": [t.as_json() for t in eval_turns], "targets": TARGETS,
    }

    best = {"score": None, "step": None, "weights": []}

    def write_log(final: bool = False) -> None:
        train_log = {**meta, "state": {k: v for k, v in state.items() if k not in ("history", "evals")},
                     "history": state["history"], "evals": state["evals"], "final": final, "best": best,
                     "workers": {"fresh_rows": source.n_fresh, "echoed_rows": source.n_echo,
                                 "errors": source.errors[-3:]}}
        _atomic_write(out / "train_log.json", (json.dumps(train_log, indent=1) + "\n").encode())
        try:
            plot(out / "loss.png", state["history"], state["evals"])
        except Exception as e:  # a missing plot must not cost the run (train_log.json has the numbers)
            log(f"loss.png not written: {type(e).__name__}: {e}")

    def checkpoint() -> None:
        """The resumable state (the latest weights and the optimizer), outside --out."""
        try:
            ck = {"model": model.state_dict(), "optimizer": opt.state_dict(), "state": state, "shape": shape}
            tmp = ckpt_path.with_name(ckpt_path.name + ".tmp")
            torch.save(ck, tmp)
            os.replace(tmp, ckpt_path)
        except Exception as e:  # the export is what matters
            log(f"checkpoint {ckpt_path} not written: {e}")

    def keep_if_best(res: dict) -> None:
        """Export the weights when they beat every earlier evaluation on
        held-out exact arguments (teacher-forced; ties go to reply token
        accuracy): --out always holds the best model seen."""
        a = res.get("all", {})
        score = [a.get("exact_args", 0.0), a.get("token_acc", 0.0)]
        if best["score"] is not None and score <= best["score"]:
            return
        t = time.monotonic()
        best.update(score=score, step=state["step"], tokens=state["tokens"],
                    weights=export_hf(model, out, tok, shape, args.save_dtype, int(args.max_shard_mb * 1e6)))
        write_log()
        log(f"best so far (held-out exact args {score[0]:.1%}): exported {', '.join(best['weights'])} "
            f"({time.monotonic() - t:.1f}s)")

    def evaluate() -> dict:
        t = time.monotonic()
        res = tf_eval.run(model, device, autocast)
        res.update(step=state["step"], tokens=state["tokens"], time=time.monotonic() - T0)
        state["evals"].append(res)
        a = res.get("all", {})
        log(f"eval step {state['step']}: held-out calls right tool {a.get('right_tool', 0):.0%}, exact args "
            f"{a.get('exact_args', 0):.0%}, reply token acc {a.get('token_acc', 0):.1%} (workflow "
            f"{res.get('workflow', {}).get('exact_args', 0):.0%}, "
            f"task {res.get('task calls', {}).get('exact_args', 0):.0%}"
            f", held-out args {res.get('held-out args', {}).get('exact_args', 0):.0%} exact; answers exact "
            f"{res.get('answers', {}).get('exact_args', 0):.0%}) [{time.monotonic() - t:.1f}s]")
        if wandb_run is not None:
            wandb_run.log({f"eval/{k}": v for k, v in a.items()}, step=state["step"])
        keep_if_best(res)
        return res

    # Running sums per loss code: loss, correct, count (on device: no sync per step).
    acc_sums = torch.zeros(3, 4, device=device)
    loop_start = time.monotonic()
    last_log = last_eval = last_ckpt = loop_start
    tokens_at_log = state["tokens"]
    step_s = None  # seconds per step, measured over the last 10 steps (with the batch fetch)
    sync_t, sync_step = loop_start, state["step"]
    met_in_row = 0
    first_step = True
    log(f"training until {deadline - reserve - T0:.0f}s (loop starts at {loop_start - T0:.0f}s)")
    model.train()
    while True:
        now = time.monotonic()
        budget_end = deadline - reserve
        if stopper.requested:
            break
        if now + 2 * (step_s or 0.0) > budget_end:
            break
        frac = min(1.0, (now - loop_start) / max(budget_end - loop_start, 1e-9))
        # Curriculum: synthetic copy rows until copying has formed, then anneal.
        if state["phase"] == "warmup" and (state["copy_acc"] >= args.copy_acc or frac >= args.warmup_max_frac):
            state["phase"], state["anneal_start"] = "anneal", frac
            log(f"warm-up over at step {state['step']} (copy accuracy {state['copy_acc']:.0%}): annealing")
        if state["phase"] == "warmup":
            p_syn = args.p_syn_start
        elif state["phase"] == "anneal":
            k = min(1.0, max(0.0, (frac - state["anneal_start"]) / max(args.anneal_frac, 1e-9)))
            p_syn = args.p_syn_start + k * (args.p_syn_end - args.p_syn_start)
        else:  # a resumed run whose warm-up is over
            p_syn = args.p_syn_end
        source.set_p_syn(p_syn)
        lr = lr_at(state["step"], frac, args)
        for g in opt.param_groups:
            g["lr"] = lr

        ids_np, codes_np = source.take(rows_per_batch)
        ids = torch.from_numpy(ids_np)
        codes = torch.from_numpy(codes_np[:, 1:].astype(np.int64))
        if cuda:
            ids, codes = ids.pin_memory().to(device, non_blocking=True), codes.pin_memory().to(device, non_blocking=True)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        t_step = time.monotonic()
        try:
            with autocast():
                logits = fwd(inputs)
        except Exception as e:
            if fwd is eager:
                raise
            log(f"compiled model failed ({type(e).__name__}: {e}); eager from here")
            fwd = eager
            with autocast():
                logits = fwd(inputs)
        logits = logits.float()
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        ce = ce.view_as(targets)
        w = weights[codes]
        loss = (ce * w).sum() / w.sum().clamp_min(1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        with torch.no_grad():
            correct = (logits.argmax(-1) == targets).float()
            onehot = F.one_hot(codes, 4).float()  # [B, T, 4]
            acc_sums[0] += torch.einsum("bt,btc->c", ce.detach(), onehot)
            acc_sums[1] += torch.einsum("bt,btc->c", correct, onehot)
            acc_sums[2] += onehot.sum((0, 1))
        del logits
        state["step"] += 1
        state["tokens"] += inputs.numel()
        if first_step or state["step"] % 10 == 0:
            if cuda:
                torch.cuda.synchronize()
            t = time.monotonic()
            if first_step:
                log(f"first step {t - t_step:.2f}s (loss {loss.item():.3f})")
                first_step = False
                step_s = t - now
            else:
                step_s = (t - sync_t) / max(1, state["step"] - sync_step)
            sync_t, sync_step = t, state["step"]

        now = time.monotonic()
        if now - last_log >= log_every:
            sums = acc_sums.detach().to("cpu", copy=True)
            acc_sums.zero_()
            row = {"step": state["step"], "tokens": state["tokens"], "time": now - T0, "lr": lr, "p_syn": p_syn,
                   "loss": float(loss.item()), "grad_norm": float(gnorm),
                   "tok_s": (state["tokens"] - tokens_at_log) / (now - last_log)}
            for c, name in D.CODE_NAMES.items():
                n = float(sums[2, c])
                row[f"loss_{name}"] = float(sums[0, c]) / n if n else None
                row[f"acc_{name}"] = float(sums[1, c]) / n if n else None
            if row["acc_synthetic"] is not None:
                state["copy_acc"] = row["acc_synthetic"]
            state["history"].append(row)
            tokens_at_log, last_log = state["tokens"], now
            log(f"step {state['step']} {state['tokens'] / 1e6:.1f}M tok {row['tok_s'] / 1e3:.0f}k tok/s "
                f"loss {row['loss']:.3f} | assistant {row['loss_assistant'] or 0:.3f} "
                f"acc {row['acc_assistant'] or 0:.1%} | copy {row['loss_synthetic'] or 0:.3f} "
                f"acc {row['acc_synthetic'] or 0:.1%} | ctx {row['loss_context'] or 0:.3f} | lr {lr:.2e} "
                f"p_syn {p_syn:.2f} | rows fresh {source.n_fresh} echo {source.n_echo}")
            if wandb_run is not None:
                wandb_run.log({k: v for k, v in row.items() if v is not None}, step=state["step"])
        if now - last_eval >= eval_every:
            res = evaluate()
            last_eval = time.monotonic()
            a = res.get("all", {})
            met = all(a.get(k, 0) >= v for k, v in TARGETS.items())
            met_in_row = met_in_row + 1 if met else 0
            if args.stop_at_targets and met_in_row >= 2:
                log("targets met twice in a row: stopping")
                break
        if now - last_ckpt >= args.ckpt_every:
            checkpoint()
            write_log()
            last_ckpt = time.monotonic()

    state["train_s"] += time.monotonic() - loop_start
    log(f"loop over: step {state['step']}, {state['tokens'] / 1e6:.1f}M tokens")
    evaluate()
    checkpoint()
    write_log(final=True)
    if wandb_run is not None:
        try:
            wandb_run.finish()
        except Exception:
            pass
    log(f"done in {time.monotonic() - T0:.0f}s; files: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
