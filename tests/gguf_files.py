"""Small GGUF files written with the `gguf` package's own writer, as llama.cpp's
converter lays them out (q/k rows permuted for ggml's RoPE, ggml's dimension
order), from a random Hugging Face Llama and the embedded tokenizer: the
inputs of the GGUF parity tests, which compare our reading of them with
transformers' own GGUF loading of the same file."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agentkv.model.default import SMALL_MODEL_DIR

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
_CONTROL, _USER_DEFINED, _NORMAL = 3, 4, 1


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf's LlamaModel.permute.
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_fields() -> tuple[list[str], list[int], list[str]]:
    spec = json.loads((SMALL_MODEL_DIR / "tokenizer.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    special = set()
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
        special.add(added["id"])
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [_CONTROL if i < 3 else _USER_DEFINED if i in special else _NORMAL for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges


def random_llama(tied: bool, seed: int = 0) -> LlamaForCausalLM:
    tokens, _, _ = _tokenizer_fields()
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, tie_word_embeddings=tied,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms, so a norm wired to the wrong place shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
    return model


def write_gguf(model, path: Path, qtype: str, pre: str = "gpt2", arch: str = "llama") -> Path:
    """model (a Hugging Face Llama, or a Qwen3 with arch "qwen3") as a GGUF
    file whose 2-D weights are stored as qtype (norms stay F32)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    cfg = model.config
    tokens, types, merges = _tokenizer_fields()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    if arch != "llama":  # llama's files leave it to hidden / heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, layer, *rest = name.split(".")
            out = f"blk.{layer}.{parts['.'.join(rest[:-1])]}.{rest[-1]}"
        else:
            out = names[name]
        data = tensor.float().numpy()
        # Only Llama's q/k rows are permuted: Qwen's stay in halves (ggml's NEOX RoPE).
        if arch == "llama" and ".self_attn.q_proj." in name:
            data = _permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            data = _permute(data, cfg.num_key_value_heads)
        if data.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            w.add_tensor(out, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(out, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
