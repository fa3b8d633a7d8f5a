"""llama.cpp through llama-cpp-python (optional, its own venv: bash
experiments/drivers/peers/setup_llamacpp.sh), on a GGUF of the same weights,
driven by experiments/drivers/peers/llamacpp_driver.py. keep: one context per agent
and llama.cpp's longest-prefix KV reuse across calls; reset: a reset before
every turn."""
from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from agentkv.experiments.drivers.peer import PeerSystem
from agentkv.experiments.drivers.system import ROOT, Request, rel

LLAMACPP_VENV = ROOT / ".venv-llamacpp"
KINDS = ("llamacpp-keep", "llamacpp-reset")


def llamacpp_status() -> str | None:
    """None when the llama.cpp venv is usable, else why not."""
    py = LLAMACPP_VENV / "bin" / "python"
    if not py.is_file():
        return (f"llama-cpp-python is not installed (optional: bash experiments/drivers/peers/setup_llamacpp.sh "
                f"builds it from source into {rel(LLAMACPP_VENV)}, about 9 minutes on 2 cores)")
    probe = subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True, text=True)
    if probe.returncode:
        return f"llama_cpp does not import in {rel(LLAMACPP_VENV)}: {probe.stderr.strip()[-200:]}"
    return None


def llamacpp_system(kind: str, path: Path, reqs: list[Request], *, dtype: str, threads: int, log: Path,
                    timeout: float | None = None, flash_attn: bool = False,
                    threads_batch: int | None = None) -> PeerSystem:
    """One of KINDS, loaded and warmed up. flash_attn: llama.cpp's fused
    attention (off by default in llama-cpp-python's Llama, as here);
    threads_batch: llama.cpp's threads for batches of more than one token
    (the prefill), by default threads."""
    keep = kind == "llamacpp-keep"
    ctx_len: dict[str, int] = {}
    for r in reqs:
        key = r.agent if keep else "all"
        ctx_len[key] = max(ctx_len.get(key, 0), len(r.ids) + r.gen + 16)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    gguf_type = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype]
    if path.is_file():  # a GGUF file: llama.cpp runs it as it is (the KV cache in dtype)
        gguf, path = path, path.parent
    else:  # converted once per checkpoint, kept out of the checkpoint's own folder (it may be tracked)
        tag = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
        gguf = ROOT / "runs" / "gguf" / f"{path.resolve().name}-{tag}-{gguf_type}.gguf"
    spec = {"model": str(path.resolve()), "threads": threads, "threads_batch": threads_batch or threads, "keep": keep,
            "ctx_len": ctx_len, "gguf": str(gguf),
            "gguf_type": gguf_type, "warmup_ids": reqs[0].ids[:64], "flash_attn": flash_attn}
    return PeerSystem(kind, [str(LLAMACPP_VENV / "bin" / "python"),
                             str(ROOT / "experiments/drivers/peers/llamacpp_driver.py")], env, spec, log, timeout)
