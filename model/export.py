"""Any model the loader reads (a GGUF file, an adapter over a base, a
checkpoint) written out as a Hugging Face checkpoint directory: the same
weights, dequantized and merged once, with the tokenizer and chat template,
so that transformers and vLLM serve exactly what the engine serves."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from agentkv.model.base_model import file_sha256
from agentkv.model.config import ModelConfig
from agentkv.model.errors import ModelLoadError
from agentkv.model.loader import load_model, load_tokenizer, parse_dtype, save_model
from agentkv.model.shapes import SHAPES, is_shape, parse_shape


# transformers' class of each model_type the engine runs (config.json's "architectures").
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM"}


def hf_config(cfg: ModelConfig, dtype: str) -> dict:
    """config.json for cfg (the fields ModelConfig.from_hf reads back)."""
    out = {
        "architectures": [ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling, "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu", "attention_bias": cfg.o_bias, "mlp_bias": cfg.mlp_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
        "torch_dtype": dtype,
    }
    if cfg.model_type == "qwen2":
        out.pop("attention_bias")
    return out


SOURCE_FILE = "export_source.json"


def source_digest(source: str | Path) -> str:
    """The sha256 of what a model path holds (a file, or a folder's files):
    an adapter retrained in place is another source. A shape holds its
    table's config and its seed (its weights follow from them)."""
    if is_shape(source):
        name, seed = parse_shape(source)
        return hashlib.sha256(json.dumps({"shape": SHAPES[name], "seed": seed}, sort_keys=True).encode()).hexdigest()
    source = Path(source)
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def export_hf(source: str | Path, out: str | Path, dtype: str = "bfloat16") -> Path:
    """source as an HF checkpoint in out (written whole to a temporary folder,
    then renamed); an export of the same source's same contents is reused."""
    # A shape names no file: as a Path, "shape:x" would resolve under the working directory.
    shape = is_shape(source)
    source, out = (str(source) if shape else Path(source)), Path(out)
    digest = source_digest(source)
    stamp = out / SOURCE_FILE
    if stamp.is_file() and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        if json.loads(stamp.read_text()).get("digest") == digest:
            return out
    model = load_model(source, "float32")
    tok = load_tokenizer(source)
    if tok is None:
        raise ModelLoadError(f"{source} has no tokenizer to export")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    # One rounding, from the float32 weights the loader made (dequantized, merged).
    save_model(model, tmp, hf_config(model.cfg, dtype), parse_dtype(dtype))
    tok.backend.save(str(tmp / "tokenizer.json"))
    special = dict(tok.special_tokens)
    config = {**special, "chat_template": tok.chat_template, "model_max_length": model.cfg.max_position_embeddings,
              "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": model.cfg.bos_token_id, "eos_token_id": tok.eos_token_ids}, indent=2))
    (tmp / SOURCE_FILE).write_text(json.dumps({"source": source if shape else str(source.resolve()), "digest": digest}, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
