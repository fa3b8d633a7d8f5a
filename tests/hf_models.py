"""Small random-init Hugging Face checkpoints, the independent reference for the
hand-written model: each covers a feature the loader and forward must honour."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
    Qwen3ForCausalLM,
)

COMMON = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=512,
    eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

HF_MODELS = {
    # GQA 4:1, llama3 rope scaling, tied embeddings
    "llama-gqa-llama3rope-tied": (LlamaForCausalLM, LlamaConfig, dict(
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    # MHA, linear rope scaling, attention and mlp biases, untied
    "llama-mha-linearrope-bias": (LlamaForCausalLM, LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False, attention_bias=True,
        mlp_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # q/k/v bias, GQA 2:1, head_dim not hidden/heads
    "qwen2-qkvbias": (Qwen2ForCausalLM, Qwen2Config, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)),
    # per-head q/k norms, GQA 2:1, head_dim 32 with hidden/heads 16, untied
    "qwen3-qknorm": (Qwen3ForCausalLM, Qwen3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    # sliding window attention shorter than the test sequences
    "mistral-window": (MistralForCausalLM, MistralConfig, dict(
        num_attention_heads=4, num_key_value_heads=1, sliding_window=24, tie_word_embeddings=False)),
}


def make_hf_model(name: str, path: Path, seed: int = 0):
    cls, cfg_cls, extra = HF_MODELS[name]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**COMMON, **extra)).eval()
    # Random norms and biases so that a weight wired to the wrong place shows.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if n.endswith("norm.weight") else 0.0))
    model.save_pretrained(path)
    return model
