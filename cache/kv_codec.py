"""How the second KV tier stores a run of tokens' KV ([token, layer, K/V,
kv_head, head_dim]): as the pool holds it ("pool", bit-exact), or as int8
with one scale per token, layer, K/V and head ("int8": a quarter of fp32's
bytes, half of bf16's; its error is measured in tests/test_kv_tier.py)."""
from __future__ import annotations

import torch

CODECS = ("pool", "int8")


def encode(kv: torch.Tensor, codec: str) -> dict[str, torch.Tensor]:
    if codec == "pool":
        return {"kv": kv}
    if codec == "int8":
        x = kv.float()
        scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
        return {"q": torch.round(x / scale).clamp_(-127, 127).to(torch.int8), "scale": scale}
    raise ValueError(f"unknown KV codec {codec!r}; choose from {', '.join(CODECS)}")


def decode(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if "kv" in parts:
        return parts["kv"]
    return (parts["q"].float() * parts["scale"]).to(dtype)


def nbytes(parts: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in parts.values())
