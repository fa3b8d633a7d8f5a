"""Model configuration read from a Hugging Face config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from agentkv.model.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", "factor": ..., ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # Qwen3: each head's q and k RMS-normalized (weights [head_dim]) before RoPE.
    qk_norm: bool = False
    # Per-layer sliding window in tokens, 0 for full attention.
    sliding_windows: tuple[int, ...] = field(default=())
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # The checkpoint's own dtype name ("bfloat16", ...), what dtype "auto" loads.
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim {self.head_dim} must be even for RoPE")
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (0,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ModelLoadError("sliding_windows must name one window per layer")

    @staticmethod
    def from_hf(cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        try:
            heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            layers = cfg["num_hidden_layers"]
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ("default", "linear", "llama3"):
                raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (default, linear, llama3)")
            eos = cfg.get("eos_token_id")
            return ModelConfig(
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or hidden // heads,
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
                tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                qkv_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
                o_bias=model_type != "qwen2" and cfg.get("attention_bias", False),
                mlp_bias=cfg.get("mlp_bias", False),
                qk_norm=model_type == "qwen3",
                sliding_windows=_sliding_windows(cfg, model_type, layers),
                model_type=model_type,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos])),
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks {e.args[0]!r}") from None

    @staticmethod
    def from_dir(path: str | Path) -> "ModelConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ModelLoadError(f"no config.json in {path}")
        return ModelConfig.from_hf(json.loads(file.read_text()))


def _sliding_windows(cfg: dict, model_type: str, layers: int) -> tuple[int, ...]:
    window = cfg.get("sliding_window") or 0
    if model_type == "mistral":
        return (window,) * layers
    if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        types = cfg.get("layer_types")
        if types:
            return tuple(window if t == "sliding_attention" else 0 for t in types)
        start = cfg.get("max_window_layers", layers)
        return tuple(window if i >= start else 0 for i in range(layers))
    return (0,) * layers
