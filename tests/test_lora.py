"""LoRA adapters (model/lora.py): attached for training they start from the
base model exactly and train only themselves; merged at load they equal, bit
for bit, a merged checkpoint saved from the same base."""
from __future__ import annotations

import json

import pytest
import torch

from agentkv.model import lora
from agentkv.model.dense_forward import dense_hidden, dense_logits
from agentkv.model.errors import ModelLoadError
from agentkv.model.loader import load_model, load_tokenizer, save_model
from tests.hf_models import make_hf_model

IDS = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    make_hf_model("llama-gqa-llama3rope-tied", path)
    return path


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return dense_logits(model, dense_hidden(model, IDS))


def _trained_adapter(base_dir, steps: int = 3):
    model = load_model(base_dir, "float32")
    cfg = lora.LoRAConfig(rank=4, alpha=8.0)
    params = lora.attach(model, cfg, seed=1)
    opt = torch.optim.SGD(params.values(), lr=0.5)
    for _ in range(steps):
        logits = dense_logits(model, dense_hidden(model, IDS[:, :-1]))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), IDS[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, params, cfg


def test_attached_adapter_starts_at_the_base_and_trains_only_itself(base_dir):
    base = load_model(base_dir, "float32")
    model = load_model(base_dir, "float32")
    params = lora.attach(model, lora.LoRAConfig(rank=4, alpha=8.0))
    assert torch.equal(_logits(model), _logits(base))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".A", ".B")) for n in trainable)
    assert len(params) == 2 * 4 * len(model.blocks)
    model, params, _ = _trained_adapter(base_dir)
    assert not torch.allclose(_logits(model), _logits(base))
    for name, p in base.named_parameters():  # the frozen base weights did not move
        if "blocks.0.attn.qkv_weight" == name:
            assert torch.equal(model.blocks[0].attn.parametrizations.qkv_weight.original, p)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_at_load_equals_a_merged_checkpoint_bit_for_bit(base_dir, tmp_path, dtype):
    trained, params, cfg = _trained_adapter(base_dir)
    adapter = tmp_path / "adapter"
    lora.save_adapter(adapter, params, cfg, {"path": str(base_dir)})
    (adapter / "chat_template.jinja").write_text("{{ messages[0].content }}")
    merged = load_model(base_dir, "float32")
    lora.merge(merged, lora.adapter_tensors(params), cfg)
    hf_config = json.loads((base_dir / "config.json").read_text())
    save_model(merged, tmp_path / "merged", hf_config)
    at_load = load_model(adapter, dtype)
    from_checkpoint = load_model(tmp_path / "merged", dtype)
    for (name, a), (_, b) in zip(at_load.named_parameters(), from_checkpoint.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    # and it computes what the trained (unmerged) model computes
    torch.testing.assert_close(_logits(load_model(adapter, "float32")), _logits(trained), atol=1e-4, rtol=1e-4)


def test_adapter_over_a_gguf_base_brings_its_chat_template(tmp_path):
    pytest.importorskip("gguf")
    from tests.gguf_files import random_llama, write_gguf

    base = write_gguf(random_llama(tied=True), tmp_path / "base.gguf", "Q8_0")
    model = load_model(base, "float32")
    cfg = lora.LoRAConfig(rank=2, alpha=2.0)
    params = lora.attach(model, cfg, seed=3)
    with torch.no_grad():
        for p in params.values():
            p.normal_()
    adapter = tmp_path / "adapter"
    lora.save_adapter(adapter, params, cfg, {"path": "../base.gguf"})
    (adapter / "chat_template.jinja").write_text("[{{ messages[0].content }}]")
    tok = load_tokenizer(adapter)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
    assert tok.encode("<|im_start|>") == [1] and tok.eos_token_ids == [2]
    merged = load_model(adapter, "float32")
    assert not torch.equal(merged.blocks[0].mlp.down_weight, load_model(base, "float32").blocks[0].mlp.down_weight)


def test_an_adapter_for_another_shape_is_refused(base_dir, tmp_path):
    _, params, cfg = _trained_adapter(base_dir, steps=1)
    tensors = lora.adapter_tensors(params)
    tensors["blocks.0.attn.o_weight.A"] = torch.zeros(3, cfg.rank)
    with pytest.raises(ModelLoadError, match="blocks.0.attn.o_weight"):
        lora.merge(load_model(base_dir, "float32"), tensors, cfg)
    del tensors["blocks.0.attn.o_weight.A"]
    with pytest.raises(ModelLoadError, match="missing"):
        lora.merge(load_model(base_dir, "float32"), tensors, cfg)
