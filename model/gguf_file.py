"""GGUF checkpoints (llama.cpp's format) read into the engine's model layout.

Read with the `gguf` package (llama.cpp's own reader on PyPI): the config
from the architecture's metadata keys, every tensor dequantized to float32 by
gguf's own quantization code and renamed to its Hugging Face name and layout,
so model.loader assembles the Transformer exactly as from a safetensors
checkpoint. The tokenizer and chat template come from the same file
(model.gguf_tokenizer).

llama.cpp's converter permutes the rows of Llama's q and k projections into
the interleaved-pairs RoPE layout ggml computes in; the engine (like
transformers) rotates halves, so those rows are permuted back here. Qwen2
and Qwen3 files are written unpermuted (ggml runs them in the halves layout,
NEOX).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from agentkv.model.config import ModelConfig
from agentkv.model.errors import ModelLoadError, UnsupportedModelError

# Quantization types this loader dequantizes (gguf's numpy code does the work).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors llama.cpp derives or stores for its own kernels; the engine computes them from the config.
_IGNORED = ("rope_freqs.weight",)


def open_gguf(path: Path):
    """gguf's reader over path; a clear error when the file or the package is missing."""
    try:
        from gguf import GGUFReader
    except ImportError:  # a declared dependency; a broken install says so plainly
        raise ModelLoadError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    try:
        return GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def field_value(reader, key: str, default=None):
    """A metadata value as Python (str, int, float, bool or list), or default."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture(reader) -> str:
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope_scaling(reader, arch: str) -> dict | None:
    kind = field_value(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported (none, linear)")
    return {"rope_type": "linear", "factor": float(field_value(reader, f"{arch}.rope.scaling.factor", 1.0))}


def gguf_config(reader, tensor_names: set[str]) -> ModelConfig:
    """The model's config from the architecture's metadata keys."""
    arch = architecture(reader)

    def key(name: str, default=None):
        value = field_value(reader, f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{name}")
        return value

    heads, hidden = key("attention.head_count"), key("embedding_length")
    vocab = field_value(reader, f"{arch}.vocab_size") or len(field_value(reader, "tokenizer.ggml.tokens", []))
    if not vocab:
        raise ModelLoadError("GGUF metadata gives no vocabulary size")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    hf = {
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "max_position_embeddings": key("context_length", 2048),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(reader, arch),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names and arch != "qwen2",
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "torch_dtype": "float32",  # dequantized: the file's own type is not a torch dtype
    }
    return ModelConfig.from_hf(hf)


def _hf_name(name: str) -> str | None:
    stem, _, kind = name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{kind}"
    return None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    # Inverse of llama.cpp's convert_hf_to_gguf permute: rows per head go
    # from (pairs, 2) interleaved back to (2 halves, pairs).
    rows = w.shape[0] // heads // 2
    return w.reshape(heads, rows, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    from gguf import quants

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"GGUF tensor {tensor.name} has quantization type {kind}, which is not supported; "
            f"supported: {', '.join(SUPPORTED_TYPES)}"
        )
    values = quants.dequantize(tensor.data, tensor.tensor_type)
    # ggml lists dimensions fastest first; numpy (and HF) want them slowest first.
    return np.asarray(values, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


@dataclass
class GGUFWeights:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # Hugging Face names and layout, float32


def read_gguf_weights(path: str | Path) -> GGUFWeights:
    """The config and every tensor of a GGUF file, under HF names, float32."""
    path = Path(path)
    reader = open_gguf(path)
    names = {t.name for t in reader.tensors}
    cfg = gguf_config(reader, names)
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name in _IGNORED:
            continue
        hf = _hf_name(tensor.name)
        if hf is None:
            raise UnsupportedModelError(f"GGUF tensor {tensor.name!r} has no place in a {cfg.model_type} model")
        values = _dequantize(tensor)
        if cfg.model_type == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            values = _unpermute(values, cfg.num_heads if ".attn_q." in tensor.name else cfg.num_kv_heads)
        tensors[hf] = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy, not a view of the mmap
    return GGUFWeights(cfg, tensors)


def is_gguf(path: str | Path) -> bool:
    """Whether path names a GGUF file (by its magic, not only its suffix)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"
