"""The embedded default model: the project's own small agent model, trained by
experiments/default_model/train.py on generated tool-calling transcripts and
shipped in Hugging Face layout under models/agent-8m. Nothing is downloaded.

random_init gives deterministic random weights, for benchmarks and tests of
model shapes the project does not train.
"""
from __future__ import annotations

from pathlib import Path

import torch

from agentkv.model.errors import ModelLoadError
from agentkv.model.llama import Transformer

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "agent-8m"
# The fast model of the unit tests, named apart from the default.
SMALL_MODEL_DIR = DEFAULT_MODEL_DIR


def default_model_dir() -> Path:
    if not (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        raise ModelLoadError(f"the embedded default model is missing from {DEFAULT_MODEL_DIR}")
    return DEFAULT_MODEL_DIR


def small_model_dir() -> Path:
    return default_model_dir()


def random_init(model: Transformer, seed: int) -> None:
    """Normal(0, 0.02) weights, unit norms: deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed)
    # Writes under no_grad, not through .data: they must move the weights'
    # version counters, by which packed copies notice (packed_linear.PackedWeights).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)  # drawn on the CPU: same weights on any device
        if model.cfg.tie_word_embeddings:
            model.lm_head.copy_(model.embed.t())
