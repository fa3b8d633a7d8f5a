"""The embedded default model: made by the project's own code on first use and
cached on disk, never downloaded.

Until the project's trained agent model ships, it is a small Llama with
deterministic random weights over the project's own byte-level BPE tokenizer.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from model.config import ModelConfig
from model.default_tokenizer import build_default_tokenizer
from model.llama import Transformer
from model.loader import save_model
from model.tokenizer import Tokenizer

VERSION = "random-v2"
SEED = 1234


def default_hf_config(vocab_size: int, eos_token_id: int, bos_token_id: int | None) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def random_init(model: Transformer, seed: int) -> None:
    """Normal(0, 0.02) weights, unit norms: deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm"):
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.02)  # drawn on the CPU: same weights on any device
    if model.cfg.tie_word_embeddings:
        model.lm_head.data.copy_(model.embed.data.t())


def default_model_dir() -> Path:
    root = Path(os.environ.get("AGENTKV_HOME", Path.home() / ".cache" / "agentkv"))
    path = root / f"default-{VERSION}"
    if not (path / "model.safetensors").is_file():
        _build(path)
    return path


def _build(path: Path) -> None:
    # Build beside the target and rename, so a crash never leaves half a model.
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    build_default_tokenizer(tmp)
    tok = Tokenizer.from_dir(tmp)
    hf = default_hf_config(tok.vocab_size, tok.eos_token_ids[0], tok.bos_token_id)
    model = Transformer(ModelConfig.from_hf(hf))
    random_init(model, SEED)
    save_model(model, tmp, hf)
    try:
        tmp.rename(path)
    except OSError:
        if not (path / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp)  # another process finished first
