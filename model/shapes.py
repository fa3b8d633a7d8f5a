"""Seeded random-weight checkpoints of real models' shapes: `--model
shape:NAME` (or shape:NAME@SEED) anywhere a model is loaded, for benchmarks
and tests at real sizes without a download. The weights are random
(model.default.random_init): such a model serves at the real model's cost
and never gives a real answer.

SHAPES holds the fields of each model's published config.json on the
Hugging Face Hub (the repository named beside it), as ModelConfig.from_hf
reads them. The tokenizer is the embedded default model's (SmolLM2's, 49152
ids): every shape's vocabulary holds its ids, the rest are never produced
by encoding.
"""
from __future__ import annotations

import torch

from agentkv.model.config import ModelConfig
from agentkv.model.default import random_init
from agentkv.model.errors import ModelLoadError
from agentkv.model.llama import Transformer

PREFIX = "shape:"
# The seed of shape:NAME without @SEED: the same weights on every machine and run.
DEFAULT_SEED = 0

# The config.json fields of each row below, in its order.
_COLUMNS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta",
            "rms_norm_eps", "tie_word_embeddings")
_ROWS = {  # each from the config.json of the Hugging Face Hub repository named beside it
    "qwen3-0.6b": ("qwen3", 151936, 1024, 3072, 28, 16, 8, 128, 40960, 1e6, 1e-6, True),  # Qwen/Qwen3-0.6B
    "qwen2.5-0.5b": ("qwen2", 151936, 896, 4864, 24, 14, 2, 64, 32768, 1e6, 1e-6, True),  # Qwen/Qwen2.5-0.5B-Instruct
    "llama3.2-1b": ("llama", 128256, 2048, 8192, 16, 32, 8, 64, 131072, 5e5, 1e-5, True),  # meta-llama/Llama-3.2-1B
    "smollm2-135m": ("llama", 49152, 576, 1536, 30, 9, 3, 64, 8192, 1e5, 1e-5, True),  # HuggingFaceTB/SmolLM2-135M
    "smollm2-360m": ("llama", 49152, 960, 2560, 32, 15, 5, 64, 8192, 1e5, 1e-5, True),  # HuggingFaceTB/SmolLM2-360M
}
# What a row's columns leave out: Llama 3.2's RoPE scaling. All are published in bfloat16.
_EXTRA = {
    "llama3.2-1b": {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
}
SHAPES: dict[str, dict] = {
    name: {**dict(zip(_COLUMNS, row)), "torch_dtype": "bfloat16", **_EXTRA.get(name, {})}
    for name, row in _ROWS.items()
}


def is_shape(path: object) -> bool:
    """Whether a model path names a shape checkpoint (shape:NAME[@SEED])."""
    return str(path).startswith(PREFIX)


def parse_shape(path: object) -> tuple[str, int]:
    """(name, seed) of shape:NAME[@SEED]; ModelLoadError naming the shapes
    for an unknown name or a seed that is not an integer."""
    name, _, seed = str(path)[len(PREFIX):].partition("@")
    if name not in SHAPES:
        raise ModelLoadError(f"unknown model shape {name!r}; shapes: {', '.join(SHAPES)}")
    if not seed:
        return name, DEFAULT_SEED
    try:
        return name, int(seed)
    except ValueError:
        raise ModelLoadError(f"the seed of {path!r} must be an integer") from None


def shape_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(SHAPES[name])


def random_model(cfg: ModelConfig, dtype: torch.dtype, seed: int = DEFAULT_SEED,
                 device: str | torch.device = "cpu") -> Transformer:
    """A model of cfg's shape with random_init's weights for seed."""
    model = Transformer(cfg, dtype, device)
    random_init(model, seed)
    return model
