"""A hand-written Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) with ONE forward:
a ragged batch of sequences, each appending a chunk of new tokens whose K/V go
into its pages, attending to its cached pages plus causally within the chunk.
Prefill, a turn's delta, a decode step and a speculative verify are all this.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import nn

from agentkv.kernels import cpu_extension, cpu_layers, cpu_paged_attention, dispatch, reference
from agentkv.kernels.metadata import AttnMetadata, bucket
from agentkv.model import packed_linear
from agentkv.model.config import ModelConfig
from agentkv.model.packed_linear import PackedWeights
from agentkv.model.rope import rope_tables


def _param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def is_linear_weight(name: str) -> bool:
    """Whether a parameter of Transformer (by its qualified name) is a linear
    layer's weight, stored [in, out] (see linear)."""
    return name == "lm_head" or name.endswith("_weight")


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeights | None = None
) -> torch.Tensor:
    """x @ weight (+ bias) with weight stored [in, out]: for one-row decode
    steps on CPU this reads weights faster than [out, in].

    Each row's result must not depend on how many rows share the call, or a
    sequence's logits would depend on what else is in its step. With packed
    (see Transformer.prepack) the C++ kernel or oneDNN runs it on a packed
    copy, which holds that (model/packed_linear.py). Where nothing is packed
    (a GPU, a dtype neither runs) the plain matmul runs, and on CPU no
    invariance is claimed there: fp32 rows differ between fewer than 4 rows
    and more."""
    if packed is not None:
        return packed.linear(x, weight, bias)
    return torch.addmm(bias, x, weight) if bias is not None else x @ weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int, dtype: torch.dtype, device):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = window
        self.qkv_heads = [cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads]
        self.scale = cfg.head_dim**-0.5
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # Weights are stored [in, out] (see linear). q, k and v projections are
        # fused into one matmul, gate and up into another.
        self.qkv_weight = _param(cfg.hidden_size, q_dim + 2 * kv_dim, dtype=dtype, device=device)
        self.qkv_bias = _param(q_dim + 2 * kv_dim, dtype=dtype, device=device) if cfg.qkv_bias else None
        self.o_weight = _param(q_dim, cfg.hidden_size, dtype=dtype, device=device)
        self.o_bias = _param(cfg.hidden_size, dtype=dtype, device=device) if cfg.o_bias else None
        # Qwen3's per-head q and k norms, applied by rope_and_store before it rotates.
        self.q_norm = _param(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.k_norm = _param(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.eps = cfg.rms_norm_eps
        self.packed: PackedWeights | None = None

    def forward(
        self, ops: dispatch.StepKernels, x: torch.Tensor, meta: AttnMetadata, k_cache, v_cache, cos, sin,
        o_rows: torch.Tensor, o_heads: torch.Tensor,
    ) -> torch.Tensor:
        """x: [R, hidden], the step's T tokens and R - T padding rows (see
        Transformer.min_rows); o_rows: the [R, heads * head_dim] the output
        projection reads, whose first T rows o_heads views as [T, heads,
        head_dim]: the attention writes them there (see ForwardScratch.attention_rows)."""
        t = meta.num_tokens
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.packed)
        hq, hkv = self.num_heads, self.num_kv_heads
        # One view by head, then q, k and v as views of it: one split, one op
        # dispatched where three slices would be three.
        heads = (qkv if qkv.shape[0] == t else qkv[:t]).view(t, hq + 2 * hkv, self.head_dim)
        q, k, v = heads.split_with_sizes(self.qkv_heads, 1)
        q = ops.rope_and_store(q, k, v, cos, sin, k_cache, v_cache, meta, self.q_norm, self.k_norm, self.eps)
        ops.paged_attention(q, k_cache, v_cache, meta, self.scale, self.window, out=o_heads)
        return linear(o_rows, self.o_weight, self.o_bias, self.packed)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        self.gate_up_weight = _param(cfg.hidden_size, 2 * cfg.intermediate_size, dtype=dtype, device=device)
        self.gate_up_bias = _param(2 * cfg.intermediate_size, dtype=dtype, device=device) if cfg.mlp_bias else None
        self.down_weight = _param(cfg.intermediate_size, cfg.hidden_size, dtype=dtype, device=device)
        self.down_bias = _param(cfg.hidden_size, dtype=dtype, device=device) if cfg.mlp_bias else None
        self.packed: PackedWeights | None = None

    def forward(self, x: torch.Tensor, silu_mul: Callable = reference.silu_mul) -> torch.Tensor:
        """silu_mul: the step's (dispatch.StepKernels.silu_mul); the default
        is the differentiable reference (model/dense_forward.py trains through it)."""
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias, self.packed)
        return linear(silu_mul(gate_up), self.down_weight, self.down_bias, self.packed)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device):
        super().__init__()
        self.attn = Attention(cfg, cfg.sliding_windows[layer], dtype, device)
        self.mlp = FeedForward(cfg, dtype, device)
        self.attn_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.mlp_norm = _param(cfg.hidden_size, dtype=dtype, device=device)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(Block(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        # [hidden, vocab]; with tied embeddings a transposed copy of embed, made
        # by the loader, because the lookup and the projection want opposite layouts.
        self.lm_head = _param(cfg.hidden_size, cfg.vocab_size, dtype=dtype, device=device)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.packed: PackedWeights | None = None

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def min_rows(self) -> int:
        """The fewest rows a forward runs: a step of fewer tokens is padded
        to this many once, at the embedding, rather than at every linear
        (see linear and PackedWeights.min_rows)."""
        return self.packed.min_rows if self.packed is not None else 1

    @torch.inference_mode()
    def prepack(self, enabled: bool = True, kernel: str = "auto") -> None:
        """Run the linears on packed copies of their weights, the C++ kernel's
        or oneDNN's (kernel "auto": the C++ one where it runs this dtype on
        this device, see packed_linear.choose), packing them now;
        enabled=False goes back to plain matmuls (for ablations)."""
        chosen = packed_linear.choose(self.dtype, self.device, kernel) if enabled else None
        packed = PackedWeights(chosen) if chosen is not None else None
        for module in self.modules():
            if hasattr(module, "packed"):
                module.packed = packed
        if packed is not None:
            for name, p in self.named_parameters():
                if is_linear_weight(name):
                    packed.get(p)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttnMetadata,
        kv: torch.Tensor,
        logit_indices: torch.Tensor | None = None,
        scratch: "ForwardScratch | None" = None,
    ) -> torch.Tensor:
        """input_ids: [R] the step's T = meta.num_tokens new tokens, then any
        R - T valid ids run as padding rows (see min_rows); kv: the page
        pool's [layers, 2, pages, page_size, kv_heads, head_dim]; scratch:
        what a runner keeps for kv across steps (made afresh when None).
        Returns fp32 logits [N, vocab] at logit_indices (all T tokens when None)."""
        eps = self.cfg.rms_norm_eps
        if scratch is None or scratch.kv is not kv:
            scratch = ForwardScratch(kv)
        layers = scratch.layers
        # Chosen once for every layer (the embedded rows are like the table);
        # the blocks are run through their forward methods, not
        # Module.__call__ (no hooks are used, and its bookkeeping would be
        # paid 11 times a layer).
        ops = dispatch.select(self.embed, layers[0][0])
        cfg, dtype = self.cfg, self.embed.dtype
        o_rows, o_heads = scratch.attention_rows(input_ids.shape[0], meta.num_tokens, cfg.num_heads, cfg.head_dim, dtype)
        if ops.layer_loop and cpu_layers.runs(meta, dtype):
            loop = scratch.layer_loop(self)
            if loop is not None:
                # The lookup and the same ops in the same order as below,
                # without the Python between them (kernels/cpu_layers.py).
                return cpu_layers.forward(loop, input_ids, o_rows, meta, logit_indices)
        h = torch.embedding(self.embed, input_ids)  # [R, hidden]; the op F.embedding runs, without its Python checks
        norm, silu_mul = ops.rmsnorm, ops.silu_mul
        cos, sin = self.cos, self.sin
        residual = None
        for block, (k_cache, v_cache) in zip(self.blocks, layers):
            x, residual = norm(h, block.attn_norm, eps, residual)
            h = block.attn.forward(ops, x, meta, k_cache, v_cache, cos, sin, o_rows, o_heads)
            x, residual = norm(h, block.mlp_norm, eps, residual)
            h = block.mlp.forward(x, silu_mul)
        if logit_indices is not None:
            h, residual = h[logit_indices], residual[logit_indices]
        h, _ = norm(h, self.norm, eps, residual)
        logits = linear(h, self.lm_head, None, self.packed)
        if logit_indices is None and logits.shape[0] > meta.num_tokens:
            logits = logits[: meta.num_tokens]  # the padding rows'
        return logits.float()


class ForwardScratch:
    """What a runner keeps for the forwards over its page pool, across steps:
    each layer's (K pages, V pages) views of the pool, and the rows the
    attention writes and the output projection reads (see
    Attention.forward). One per runner, never shared between threads
    (engines may share a model, not this)."""

    def __init__(self, kv: torch.Tensor):
        self.kv = kv
        self.layers = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
        self._attention: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        # The last step's (shape key, rows, per-head view): slicing is a
        # dispatched op, and decode steps ask for the same views every step.
        self._last_rows: tuple | None = None
        # (model, its PackedWeights, the packed weights, their versions, the loop).
        self._loop: tuple | None = None

    def layer_loop(self, model: Transformer) -> torch.ScriptObject | None:
        """model's layers over this pool as one C++ loop (kernels/cpu_layers.py),
        made on first use and again after model.prepack or a write in place
        to a linear's weight (as PackedWeights repacks; replacing a weight
        tensor, like a write through .data, needs prepack again); None where
        the linears are not the C++ kernel's or it cannot be made here."""
        packed = model.packed
        if packed is None or packed.kernel != "cpp":
            return None
        kept = self._loop
        target = cpu_extension.current_isa()  # the loop calls its own ISA's ops (kernels/cpu_library.h)
        if (kept is not None and kept[0] is model and kept[1] is packed and kept[4] == target
                and [p._version for p in kept[2]] == kept[3]):
            return kept[5]
        weights = [w for b in model.blocks for w in (b.attn.qkv_weight, b.attn.o_weight, b.mlp.gate_up_weight,
                                                     b.mlp.down_weight)] + [model.lm_head]
        try:
            loop = _make_loop(model, packed, self.layers)
            if kept is None:  # the pool's first loop: time the attention's prefetch on its pages
                cpu_paged_attention.tune_prefetch(self.layers, model.cfg.num_heads)
        except RuntimeError as e:  # another extension's op missing or changed: the Python loop runs
            if not _warned_loop:
                _warned_loop.append(str(e))
                warnings.warn(f"The CPU forward runs its layers in Python: {e}", RuntimeWarning, stacklevel=3)
            loop = None
        self._loop = (model, packed, weights, [p._version for p in weights], target, loop)
        return loop

    def attention_rows(
        self, rows: int, t: int, heads: int, head_dim: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A [rows, heads * head_dim] for a forward of t <= rows tokens, and its
        first t rows as [t, heads, head_dim]: every layer's attention writes
        them, and its output projection reads all rows before the next layer
        writes again. One buffer per width and dtype, grown by powers of two
        (kernels.metadata.bucket), so a step allocates none once it has grown.
        Its padding rows (past t) hold zeros or an earlier step's attention
        rows: finite values, which reach no real row (a row of a linear's
        output depends on its own input row alone, and the invariance tests
        hold the bits), so nothing is cleared per step."""
        key = (rows, t, heads, head_dim, dtype)
        last = self._last_rows
        if last is not None and last[0] == key:
            return last[1], last[2]
        dim = heads * head_dim
        buf = self._attention.get((dim, dtype))
        if buf is None or buf.shape[0] < rows:
            buf = torch.zeros(bucket(rows), dim, dtype=dtype, device=self.kv.device)
            self._attention[dim, dtype] = buf
        o_rows = buf[:rows]
        o_heads = o_rows[:t].view(t, heads, head_dim)
        self._last_rows = key, o_rows, o_heads
        return o_rows, o_heads


_warned_loop: list[str] = []


def _make_loop(
    model: Transformer, packed: PackedWeights, caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.ScriptObject:
    cfg = model.cfg
    layers = [
        cpu_layers.LayerWeights(
            b.attn_norm, packed.get(b.attn.qkv_weight), b.attn.qkv_bias, packed.get(b.attn.o_weight), b.attn.o_bias,
            b.mlp_norm, packed.get(b.mlp.gate_up_weight), b.mlp.gate_up_bias, packed.get(b.mlp.down_weight),
            b.mlp.down_bias, b.attn.window, b.attn.q_norm, b.attn.k_norm,
        )
        for b in model.blocks
    ]
    return cpu_layers.make(
        layers, caches, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, model.embed, model.cos,
        model.sin, model.norm, packed.get(model.lm_head),
    )
