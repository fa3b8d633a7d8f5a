"""A random-init model of a named shape (experiments.common.SHAPES), saved
once in Hugging Face layout with the project's tokenizer, so that every
system (this engine, HF, vLLM, llama.cpp) loads the same weights."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from agentkv.experiments.common import SHAPES, random_model
from agentkv.experiments.drivers.system import ROOT
from agentkv.model.export import ARCHITECTURES
# The 35-turn workflow's prompts reach 28k tokens.
MAX_POSITIONS = 32768


def hf_config(shape: str, tokenizer) -> dict:
    base = dict(SHAPES[shape])
    cfg = {"architectures": [ARCHITECTURES[base["model_type"]]], **base}
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("rms_norm_eps", 1e-6)
    cfg["max_position_embeddings"] = max(base["max_position_embeddings"], MAX_POSITIONS)
    cfg.update(
        head_dim=base.get("head_dim") or base["hidden_size"] // base["num_attention_heads"], hidden_act="silu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_ids[0], torch_dtype="float32",
    )
    if base["model_type"] in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None)
    return cfg


def prepare_checkpoint(shape: str, seed: int = 0, root: Path | None = None) -> Path:
    """A random-init model of `shape` with the project's tokenizer, saved once
    in Hugging Face layout (fp32) under runs/checkpoints/."""
    from agentkv.model.default import small_model_dir
    from agentkv.model.loader import save_model
    from agentkv.model.tokenizer import Tokenizer

    root = root or ROOT / "runs" / "checkpoints"
    path = root / f"{shape}-seed{seed}"
    if (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file():
        return path
    tok_dir = small_model_dir()
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


def with_positions(src: Path, positions: int) -> Path:
    """The checkpoint at src (an HF directory) with max_position_embeddings
    raised to `positions`, its other files linked: the same weights, served
    past the context they were trained for. A replay measures serving, not
    answers, so every system gets this same directory. src itself where it
    already has that many positions."""
    cfg = json.loads((src / "config.json").read_text())
    if cfg["max_position_embeddings"] >= positions:
        return src
    path = src.with_name(f"{src.name}-pos{positions}")
    if not (path / "config.json").is_file():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True)
        for f in src.iterdir():
            if f.name != "config.json":
                (tmp / f.name).symlink_to(f.resolve())
        (tmp / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": positions}, indent=2))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    return path
