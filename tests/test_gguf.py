"""GGUF loading against transformers' own GGUF loading of the same file: the
config, every weight after dequantization and the q/k un-permutation, the
logits, the tokenizer and the chat template."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
from transformers import AutoModelForCausalLM  # noqa: E402

from agentkv.engine import Engine  # noqa: E402
from agentkv.model.errors import ModelLoadError, UnsupportedModelError  # noqa: E402
from agentkv.model.loader import load_model, load_tokenizer  # noqa: E402
from agentkv.model.tokenizer import Tokenizer  # noqa: E402
from agentkv.model.default import SMALL_MODEL_DIR  # noqa: E402
from tests.gguf_files import TEMPLATE, random_llama, write_gguf  # noqa: E402

QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
PROMPT = torch.tensor([[1, 57, 300, 1200, 7, 4000, 15, 2, 99, 512, 3, 800]])


def _our_logits(path, ids: torch.Tensor) -> torch.Tensor:
    engine = Engine.from_pretrained(path, page_size=8, num_pages=8)
    with engine.session() as s:
        return s.append(ids[0].tolist(), all_logits=True)


@pytest.fixture(scope="module", params=QTYPES)
def gguf_pair(request, tmp_path_factory):
    tied = request.param != "F32"  # one untied file: output.weight read as lm_head
    hf = random_llama(tied=tied)
    path = write_gguf(hf, tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf", request.param)
    return request.param, path


def test_logits_match_transformers_gguf_loading(gguf_pair):
    qtype, path = gguf_pair
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(PROMPT).logits[0]
    got = _our_logits(path, PROMPT)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


def test_weights_equal_transformers_dequantized_weights(gguf_pair):
    _, path = gguf_pair
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ours = load_model(path, "float32")
    block = ours.blocks[1]
    q, k, v = block.attn.qkv_weight.t().split([64, 32, 32], dim=0)
    layer = theirs.model.layers[1]
    assert torch.equal(q, layer.self_attn.q_proj.weight)
    assert torch.equal(k, layer.self_attn.k_proj.weight)
    assert torch.equal(v, layer.self_attn.v_proj.weight)
    assert torch.equal(ours.embed, theirs.model.embed_tokens.weight)
    assert torch.equal(block.mlp_norm, layer.post_attention_layernorm.weight)


def test_f32_file_holds_the_original_weights_exactly(tmp_path):
    hf = random_llama(tied=False, seed=3)
    ours = load_model(write_gguf(hf, tmp_path / "x.gguf", "F32"), "float32")
    q, k, _ = ours.blocks[0].attn.qkv_weight.t().split([64, 32, 32], dim=0)
    assert torch.equal(q, hf.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(k, hf.model.layers[0].self_attn.k_proj.weight)
    assert torch.equal(ours.lm_head.t(), hf.lm_head.weight)


def test_config_from_metadata(tmp_path):
    cfg = load_model(write_gguf(random_llama(tied=True), tmp_path / "x.gguf", "Q8_0"), "float32").cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 64, 4, 2, 16)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (128, 4096, True)
    assert cfg.rms_norm_eps == pytest.approx(1e-5) and cfg.rope_theta == 10000.0
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


@pytest.mark.parametrize("pre", ["gpt2", "smollm"])
def test_tokenizer_from_metadata_matches_the_source_tokenizer(tmp_path, pre):
    path = write_gguf(random_llama(tied=True), tmp_path / "x.gguf", "Q8_0", pre=pre)
    ours = load_tokenizer(path)
    source = Tokenizer.from_dir(SMALL_MODEL_DIR)
    texts = ["Hello world", "call <tool_call>{\"name\": \"f\"}</tool_call> now", "  spaces\n\nand\ttabs",
             "naïve café ünïcode — 東京", "<|im_start|>user\nhi<|im_end|>", "x=12345, y=-0.5"]
    for text in texts:
        ids = ours.encode(text)
        assert ours.decode(ids) == text
        if pre == "gpt2":  # the embedded tokenizer splits as GPT-2 does
            assert ids == source.encode(text), text
        else:  # smollm splits every digit off first
            assert all(len(ours.decode([i]).strip()) <= 1 for i in ids if ours.decode([i]).strip().isdigit())
    assert ours.encode("<|im_start|>") == [1] and ours.encode("<tool_call>") == [4092]
    assert ours.eos_token_ids == [2] and ours.bos_token_id == 1
    assert ours.chat_template == TEMPLATE
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>user\nhi<|im_end|>\n"


def test_engine_from_pretrained_reads_a_gguf_file(tmp_path):
    path = write_gguf(random_llama(tied=True), tmp_path / "x.gguf", "Q4_0")
    engine = Engine.from_pretrained(path, num_pages=16)
    assert engine.tokenizer is not None and engine.tokenizer.chat_template == TEMPLATE
    reply = engine.chat([{"role": "user", "content": "hi"}], max_tokens=4)
    assert len(reply.token_ids) == 4


def test_unsupported_quantization_is_named(tmp_path):
    import gguf

    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_vocab_size(4)
    w.add_tensor("token_embd.weight", np.zeros((4, 66), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="IQ2_XXS"):
        load_model(path)


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="mamba"):
        load_model(path)


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match="neither a GGUF file"):
        load_model(path)


def test_export_to_hf_gives_transformers_the_same_model_and_template(tmp_path):
    from transformers import AutoTokenizer

    from agentkv.model.export import export_hf

    path = write_gguf(random_llama(tied=True), tmp_path / "x.gguf", "Q4_1")
    out = export_hf(path, tmp_path / "hf", dtype="float32")
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(PROMPT).logits[0]
    torch.testing.assert_close(_our_logits(path, PROMPT), expected, atol=2e-4, rtol=2e-4)
    messages = [{"role": "user", "content": "hi <tool_call> 12345"}]
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    ours = load_tokenizer(path)
    assert hf_tok.apply_chat_template(messages, tokenize=False) == ours.apply_chat_template(messages, tokenize=False)
    assert hf_tok("hi <tool_call> naïve 12345", add_special_tokens=False)["input_ids"] == \
        ours.encode("hi <tool_call> naïve 12345")
    # The same source again: the export is reused. Another model in its place: exported anew.
    written = (out / "model.safetensors").stat().st_mtime_ns
    assert export_hf(path, tmp_path / "hf", dtype="float32") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == written
    write_gguf(random_llama(tied=True, seed=1), path, "Q4_1")
    export_hf(path, tmp_path / "hf", dtype="float32")
    again = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(_our_logits(path, PROMPT), again(PROMPT).logits[0], atol=2e-4, rtol=2e-4)
