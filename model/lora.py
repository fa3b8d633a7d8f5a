"""Low-rank adapters (LoRA) on the Transformer's fused projections: attached
for training, saved as a small file, merged into the weights at load.

A target weight W [in, out] (our layout: x @ W) gains delta = A @ B * scale,
A [in, rank], B [rank, out], B zero at the start so training starts from the
base model exactly. One adapter covers a fused projection whole (q, k and v
together; gate and up together): the rank is shared across the parts, which
costs no more than a separate adapter per part of rank / 3.

Merging computes W + A @ B * scale in float32 and rounds once to the
model's dtype, so merging at load gives, bit for bit, the weights a merged
checkpoint saved from the same base holds.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.utils import parametrize

from agentkv.model.errors import ModelLoadError
from agentkv.model.llama import Transformer

TARGETS = ("attn.qkv_weight", "attn.o_weight", "mlp.gate_up_weight", "mlp.down_weight")
ADAPTER_FILE, CONFIG_FILE = "adapter.safetensors", "adapter_config.json"


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class _Delta(nn.Module):
    """The parametrization: what the module reads as its weight is W + A @ B * scale."""

    def __init__(self, weight: torch.Tensor, rank: int, scale: float, gen: torch.Generator):
        super().__init__()
        fan_in, fan_out = weight.shape
        self.A = nn.Parameter(torch.randn(fan_in, rank, generator=gen) / fan_in**0.5)
        self.B = nn.Parameter(torch.zeros(rank, fan_out))
        self.scale = scale

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + (self.A @ self.B * self.scale).to(weight.dtype)


def _targets(model: Transformer, cfg: LoRAConfig):
    for i, block in enumerate(model.blocks):
        for target in cfg.targets:
            owner, _, name = target.partition(".")
            yield f"blocks.{i}.{target}", getattr(block, owner), name


def attach(model: Transformer, cfg: LoRAConfig, seed: int = 0) -> dict[str, nn.Parameter]:
    """Adapters on every target (the base weights frozen): the trainable
    parameters by adapter name ("blocks.3.attn.qkv_weight.A", ...)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    params = {}
    for name, module, attr in _targets(model, cfg):
        delta = _Delta(getattr(module, attr), cfg.rank, cfg.scale, gen)
        parametrize.register_parametrization(module, attr, delta, unsafe=True)
        params[f"{name}.A"], params[f"{name}.B"] = delta.A, delta.B
    return params


def adapter_tensors(params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().contiguous().clone() for name, p in params.items()}


def save_adapter(path: str | Path, params: dict[str, nn.Parameter], cfg: LoRAConfig, base: dict) -> None:
    """The adapter and its config (with base: what it was trained on) in a directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(adapter_tensors(params), str(path / ADAPTER_FILE))
    config = {"lora": {**asdict(cfg), "targets": list(cfg.targets)}, "base": base}
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def read_adapter_config(path: str | Path) -> tuple[LoRAConfig, dict]:
    file = Path(path) / CONFIG_FILE
    try:
        raw = json.loads(file.read_text())
        lora = raw["lora"]
        return LoRAConfig(int(lora["rank"]), float(lora["alpha"]), tuple(lora["targets"])), dict(raw["base"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot read adapter config {file}: {e}") from e


def merge(model: Transformer, tensors: dict[str, torch.Tensor], cfg: LoRAConfig) -> None:
    """W += A @ B * scale on every target, in float32, rounded once to the model's dtype."""
    params = dict(model.named_parameters())
    expected = {f"{name}.{part}" for name, _, _ in _targets(model, cfg) for part in "AB"}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ModelLoadError(f"adapter does not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, _, _ in _targets(model, cfg):
            w = params[name]
            a, b = tensors[f"{name}.A"].float(), tensors[f"{name}.B"].float()
            if a.shape != (w.shape[0], cfg.rank) or b.shape != (cfg.rank, w.shape[1]):
                raise ModelLoadError(f"adapter {name} has shapes {tuple(a.shape)} @ {tuple(b.shape)}, "
                                     f"not one for a weight of shape {tuple(w.shape)}")
            w.copy_((w.float() + a @ b * cfg.scale).to(w.dtype))


def merge_adapter_dir(model: Transformer, path: str | Path) -> None:
    cfg, _ = read_adapter_config(path)
    merge(model, load_file(str(Path(path) / ADAPTER_FILE)), cfg)
