"""A dense causal forward over a padded batch, for training the Transformer of
model/llama.py: the same modules and weights (fused [in, out] projections,
the same RoPE tables, the torch reference RMSNorm), with torch SDPA over
[batch, time] instead of the paged engine forward. It exists because the
engine forward runs under inference_mode with paged KV and custom kernels,
none of which autograd can go through; serving never calls it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from agentkv.kernels.reference import rmsnorm
from agentkv.model.llama import Attention, Transformer, linear


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # The halves convention of kernels.rope_and_store (and of HF's rotate_half).
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    b, t, hidden = x.shape
    qkv = linear(x.reshape(b * t, hidden), attn.qkv_weight, attn.qkv_bias).view(b, t, -1)
    q_dim, kv_dim = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    q = qkv[..., :q_dim].view(b, t, attn.num_heads, attn.head_dim)
    k = qkv[..., q_dim : q_dim + kv_dim].view(b, t, attn.num_kv_heads, attn.head_dim)
    v = qkv[..., q_dim + kv_dim :].view(b, t, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:  # Qwen3's per-head norms, before RoPE as rope_and_store applies them
        q, k = rmsnorm(q, attn.q_norm, attn.eps)[0], rmsnorm(k, attn.k_norm, attn.eps)[0]
    q, k = _rotate(q, cos, sin).transpose(1, 2), _rotate(k, cos, sin).transpose(1, 2)
    v = v.transpose(1, 2)
    mask = None
    if attn.window:
        i = torch.arange(t, device=x.device)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < attn.window)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=attn.scale,
                                       enable_gqa=attn.num_kv_heads != attn.num_heads)
    o = o.transpose(1, 2).reshape(b * t, q_dim)
    return linear(o, attn.o_weight, attn.o_bias).view(b, t, hidden)


def dense_hidden(model: Transformer, input_ids: torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states [B, T, hidden] of rows input_ids [B, T], each
    a sequence from position 0, causal (right padding does not reach earlier
    tokens). Differentiable in the model's parameters."""
    b, t = input_ids.shape
    eps = model.cfg.rms_norm_eps
    cos, sin = model.cos[:t, None, :], model.sin[:t, None, :]  # [T, 1, D/2] against [B, T, H, D/2]
    h = F.embedding(input_ids, model.embed)
    residual = None
    for block in model.blocks:
        x, residual = rmsnorm(h, block.attn_norm, eps, residual)
        h = _attention(block.attn, x, cos, sin)
        x, residual = rmsnorm(h, block.mlp_norm, eps, residual)
        h = block.mlp(x.reshape(b * t, -1)).view(b, t, -1)
    h, _ = rmsnorm(h, model.norm, eps, residual)
    return h


def dense_logits(model: Transformer, hidden: torch.Tensor) -> torch.Tensor:
    """Logits of hidden states; with tied embeddings through embed itself (the
    loader's transposed lm_head copy is not what training updates)."""
    if model.cfg.tie_word_embeddings:
        return F.linear(hidden, model.embed)
    return hidden @ model.lm_head


def trainable_parameters(model: Transformer) -> dict[str, torch.nn.Parameter]:
    """The parameters training updates, by name, with requires_grad turned on
    (the Transformer makes them frozen for inference); a tied lm_head is
    left out and stays frozen."""
    out = {}
    for name, p in model.named_parameters():
        if name == "lm_head" and model.cfg.tie_word_embeddings:
            continue
        p.requires_grad_(True)
        out[name] = p
    return out
