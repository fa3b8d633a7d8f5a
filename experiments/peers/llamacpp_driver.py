"""Drive llama.cpp (llama-cpp-python) over pre-rendered token ids and report
per-turn times as JSON. Runs inside .venv-llamacpp
(experiments/peers/setup_llamacpp.sh), as a subprocess of
experiments.bench_turns.

    .venv-llamacpp/bin/python experiments/peers/llamacpp_driver.py IN.json OUT.json

IN.json: {"model": dir, "gguf_type": "f32", "threads": 2, "keep": true,
          "repeats": 1, "requests": [{"ids": [...], "gen": 12, "agent": "planner"}, ...]}
OUT.json: {"llama_cpp": version, "gguf": path, "repeats": [[{"latency_s",
          "prefill_s", "decode_s", "reused", "generated"}, ...], ...]}

keep: one llama.cpp context per agent; Llama.generate reuses the longest
common prefix of the context's tokens and the new prompt (llama.cpp's
built-in KV reuse across calls) and evaluates only the rest. Without keep:
one context, reset before every turn. Greedy (temp 0, top_k 1), exactly
`gen` tokens (EOS is not checked by Llama.generate), KV cache in the GGUF's
precision. prefill_s is the time to the first token, decode_s the rest.

The checkpoint is converted to DIR/model-<type>.gguf on first use with the
converter from llama-cpp-python's source (see setup_llamacpp.sh), with the
pre-tokenizer check answered "gpt-2" (the prompts arrive as token ids, so
llama.cpp's own tokenizer never splits text here).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

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


def ensure_gguf(model_dir: Path, gguf_type: str) -> Path:
    out = model_dir / f"model-{gguf_type}.gguf"
    if out.is_file():
        return out
    tmp = out.with_suffix(f".tmp{os.getpid()}")
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
    spec = json.load(open(sys.argv[1]))
    import llama_cpp
    from llama_cpp import Llama

    gguf = ensure_gguf(Path(spec["model"]), spec.get("gguf_type", "f32"))
    kv_type = {"f32": 0, "f16": 1, "bf16": 30}[spec.get("gguf_type", "f32")]
    threads = int(spec["threads"])
    reqs = spec["requests"]
    keep = bool(spec["keep"])
    ctx_len: dict[str, int] = {}
    for r in reqs:
        key = r["agent"] if keep else "all"
        ctx_len[key] = max(ctx_len.get(key, 0), len(r["ids"]) + r["gen"] + 16)

    def new_context(n_ctx: int) -> Llama:
        return Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                     n_ubatch=512, type_k=kv_type, type_v=kv_type, logits_all=False, verbose=False, seed=0)

    def one(llm: Llama, ids: list[int], gen: int) -> dict:
        held = list(llm._input_ids[: llm.n_tokens]) if keep else []
        if not keep:
            llm.reset()
        reused = min(common_prefix(held, ids), len(ids) - 1) if keep else 0
        start = time.perf_counter()
        first = None
        out = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            out.append(tok)
            if len(out) >= gen:
                break
        end = time.perf_counter()
        return {"latency_s": end - start, "prefill_s": first - start, "decode_s": end - first, "reused": reused,
                "generated": len(out), "token_ids": [int(t) for t in out]}

    # Warm-up on a throwaway context.
    warm = new_context(512)
    one(warm, reqs[0]["ids"][:64], 4)
    del warm
    repeats = []
    for rep in range(int(spec["repeats"])):
        contexts: dict[str, Llama] = {}
        rows = []
        for i, r in enumerate(reqs):
            key = r["agent"] if keep else "all"
            if key not in contexts:
                contexts[key] = new_context(ctx_len[key])
            rows.append(one(contexts[key], r["ids"], r["gen"]))
            print(f"llamacpp keep={keep} repeat {rep + 1} turn {i + 1}/{len(reqs)}: {rows[-1]['latency_s']:.3f} s, "
                  f"reused {rows[-1]['reused']}", file=sys.stderr, flush=True)
        repeats.append(rows)
        contexts.clear()
    json.dump({"llama_cpp": llama_cpp.__version__, "gguf": str(gguf), "threads": threads, "repeats": repeats},
              open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
