"""Serve llama.cpp (llama-cpp-python) turn by turn over pre-rendered token
ids, for experiments.drivers.llamacpp. Runs inside .venv-llamacpp
(experiments/drivers/peers/setup_llamacpp.sh) as a subprocess; it imports nothing
from this repository but peer_protocol.py beside it.

    .venv-llamacpp/bin/python experiments/drivers/peers/llamacpp_driver.py < requests > replies

Protocol: JSON lines (peer_protocol.py). The first line in is the spec {"model": dir,
"gguf": path, "gguf_type": "f32", "threads": 2, "threads_batch": 2, "keep": true, "ctx_len": {agent: n},
"warmup_ids": [...], "flash_attn": false}; the driver converts the checkpoint to GGUF if needed,
warms up and answers {"ready": true, ...}. Then each line is one of
  {"op": "begin"}   a new pass over the workflow: drop every context
  {"op": "turn", "ids": [...], "gen": n, "agent": a}  one request; answers
                    {"latency_s", "prefill_s", "decode_s", "reused", "generated", "token_ids",
                    "token_s"} (token_s: each token's time from the call's start)
  {"op": "decode", ...}  the same (experiments.benchmarks.bench_decode's name for it)
  {"op": "quit"}

keep: one llama.cpp context per agent; Llama.generate reuses the longest
common prefix of the context's tokens and the new prompt (llama.cpp's
built-in KV reuse across calls) and evaluates only the rest. Without keep:
one context, reset before every turn. Greedy (temp 0, top_k 1), exactly
`gen` tokens (Llama.generate does not stop at EOS), KV cache in the GGUF's
precision. prefill_s is the time to the first token, decode_s the rest. A
context is created (its KV allocated) before the timed call.

The checkpoint is converted to GGUF on first use (to spec["gguf"], by
default DIR/model-<type>.gguf; the bench keeps it under runs/gguf/) with the
converter from llama-cpp-python's source (see setup_llamacpp.sh), with the
pre-tokenizer check answered "gpt-2" (the prompts arrive as token ids, so
llama.cpp's own tokenizer never splits text here).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from peer_protocol import open_replies, read_spec, serve

SRC = Path(sys.prefix) / "src" / "llama.cpp"
CONVERT = r"""
import sys
sys.path[:0] = [{src!r}, {gguf_py!r}]
sys.argv = ["convert_hf_to_gguf.py", *{argv!r}]
import convert_hf_to_gguf as c
# The project's BPE is not in the converter's table of pre-tokenizer hashes.
mods = [c]
try:
    import conversion.base
    mods.append(conversion.base)
except ImportError:
    pass
for mod in mods:
    for name in ("TextModel", "Model"):
        cls = getattr(mod, name, None)
        if cls is not None and hasattr(cls, "get_vocab_base_pre"):
            cls.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
c.main()
"""


def ensure_gguf(model_dir: Path, gguf_type: str, out: Path | None = None) -> Path:
    out = out or model_dir / f"model-{gguf_type}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    code = CONVERT.format(src=str(SRC), gguf_py=str(SRC / "gguf-py"),
                          argv=[str(model_dir), "--outtype", gguf_type, "--outfile", str(tmp)])
    subprocess.run([sys.executable, "-c", code], check=True, stdout=sys.stderr)
    tmp.rename(out)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    reply = open_replies()
    spec = read_spec()
    import llama_cpp
    from llama_cpp import Llama

    gguf_type = spec.get("gguf_type", "f32")
    gguf = ensure_gguf(Path(spec["model"]), gguf_type, Path(spec["gguf"]) if spec.get("gguf") else None)
    kv_type = {"f32": 0, "f16": 1, "bf16": 30}[gguf_type]
    threads = int(spec["threads"])
    # llama.cpp runs batches of more than one token (the prefill) on n_threads_batch, single tokens on n_threads.
    threads_batch = int(spec.get("threads_batch") or threads)
    keep = bool(spec["keep"])
    ctx_len: dict[str, int] = spec["ctx_len"]

    def new_context(n_ctx: int) -> Llama:
        return Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads_batch, n_batch=512,
                     n_ubatch=512, type_k=kv_type, type_v=kv_type, logits_all=False, verbose=False, seed=0,
                     flash_attn=bool(spec.get("flash_attn", False)))

    def one(llm: Llama, ids: list[int], gen: int) -> dict:
        held = list(llm._input_ids[: llm.n_tokens]) if keep else []
        if not keep:
            llm.reset()
        reused = min(common_prefix(held, ids), len(ids) - 1) if keep else 0
        start = time.perf_counter()
        stamps = []
        out = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter() - start)
            out.append(int(tok))
            if len(out) >= gen:
                break
        end = time.perf_counter() - start
        return {"latency_s": end, "prefill_s": stamps[0], "decode_s": end - stamps[0], "reused": reused,
                "generated": len(out), "token_ids": out, "token_s": stamps}

    warm = new_context(512)
    one(warm, spec["warmup_ids"], 4)
    del warm
    reply({"ready": True, "llama_cpp": llama_cpp.__version__, "gguf": str(gguf), "threads": threads,
           "threads_batch": threads_batch})
    contexts: dict[str, Llama] = {}

    def turn(msg: dict) -> dict:
        key = msg["agent"] if keep else "all"
        if key not in contexts:
            contexts[key] = new_context(int(ctx_len[key]))
        return one(contexts[key], msg["ids"], int(msg["gen"]))

    def begin(msg: dict) -> dict:
        contexts.clear()
        return {"ok": True}

    serve(reply, {"turn": turn, "decode": turn, "begin": begin})


if __name__ == "__main__":
    main()
