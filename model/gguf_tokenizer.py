"""The tokenizer stored in a GGUF file, rebuilt as a `tokenizers` tokenizer.

GGUF keeps a byte-level BPE ("gpt2" model) as its token strings, merges and
token types, and names the pre-tokenizer (how text is split before BPE) by a
short key that llama.cpp maps to its split regexes; the same splits are
built here from the `tokenizers` library's pieces. Control and user-defined
tokens become added tokens, split off before anything else, as in the
tokenizer.json the file was converted from.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from agentkv.model.errors import UnsupportedModelError
from agentkv.model.gguf_file import field_value, open_gguf
from agentkv.model.tokenizer import Tokenizer

# llama.cpp's token types (llama_token_type): which ids are added tokens.
_CONTROL, _USER_DEFINED = 3, 4
# Qwen2's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2): digits one at a time, letters with one leading mark.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    if pre == "smollm":  # SmolLM: every digit alone, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "qwen2":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise UnsupportedModelError(f"GGUF pre-tokenizer {pre!r} is not supported (gpt2, smollm, qwen2)")


def _merges(raw: list[str]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) for m in raw]


def gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The GGUF file's tokenizer, special tokens and chat template."""
    reader = open_gguf(Path(path))
    kind = field_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(f"GGUF tokenizer model {kind!r} is not supported (only gpt2, byte-level BPE)")
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
    types: list[int] = field_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {token: i for i, token in enumerate(tokens)}
    bpe = models.BPE(vocab, _merges(field_value(reader, "tokenizer.ggml.merges", [])), fuse_unk=False)
    backend = HFTokenizer(bpe)
    backend.pre_tokenizer = _pre_tokenizer(field_value(reader, "tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL])
    backend.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])

    def token(key: str) -> str | None:
        i = field_value(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    special = {f"{name}_token": token(name) for name in ("bos", "eos", "unknown", "padding")}
    special = {
        {"unknown_token": "unk_token", "padding_token": "pad_token"}.get(k, k): v for k, v in special.items() if v
    }
    template = field_value(reader, "tokenizer.chat_template")
    return Tokenizer(backend, {"default": template} if template else {}, special)
