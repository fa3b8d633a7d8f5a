"""dtype "auto": the checkpoint's own dtype where the device computes in it."""
import dataclasses

import pytest
import torch

from agentkv.model import loader
from agentkv.model.config import ModelConfig
from agentkv.model.errors import ModelLoadError
from agentkv.model.default import SMALL_MODEL_DIR

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=8, max_position_embeddings=64)


def with_dtype(name):
    return dataclasses.replace(CFG, torch_dtype=name)


@pytest.mark.parametrize("bf16_dot", [True, False])
@pytest.mark.parametrize("own, cpu_bf16, cpu_plain", [
    ("bfloat16", torch.bfloat16, torch.float32),
    ("float16", torch.float32, torch.float32),  # no fast fp16 CPU kernels
    ("float32", torch.float32, torch.float32),
    (None, torch.float32, torch.float32),  # a config that names none
])
def test_auto_takes_the_checkpoints_dtype_where_the_cpu_computes_in_it(own, cpu_bf16, cpu_plain, bf16_dot, monkeypatch):
    monkeypatch.setattr(loader, "cpu_has_bf16_dot", lambda: bf16_dot)
    assert loader.resolve_dtype("auto", with_dtype(own), "cpu") == (cpu_bf16 if bf16_dot else cpu_plain)
    # a GPU computes in every one of them
    assert loader.resolve_dtype("auto", with_dtype(own), "cuda") == loader.DTYPES.get(own or "float32")


def test_a_named_dtype_wins_over_the_checkpoints(monkeypatch):
    monkeypatch.setattr(loader, "cpu_has_bf16_dot", lambda: True)
    assert loader.resolve_dtype("float32", with_dtype("bfloat16"), "cpu") == torch.float32
    assert loader.resolve_dtype(torch.bfloat16, with_dtype("float32"), "cpu") == torch.bfloat16
    with pytest.raises(ModelLoadError, match="auto or one of"):
        loader.resolve_dtype("int8", CFG, "cpu")


def test_config_json_names_the_dtype():
    base = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    assert ModelConfig.from_hf({**base, "torch_dtype": "bfloat16"}).torch_dtype == "bfloat16"
    assert ModelConfig.from_hf({**base, "dtype": "float16"}).torch_dtype == "float16"  # newer transformers' key
    assert ModelConfig.from_hf(base).torch_dtype is None


def test_the_embedded_model_loads_in_its_own_dtype_with_auto(monkeypatch):
    from agentkv import Engine

    monkeypatch.setattr(loader, "cpu_has_bf16_dot", lambda: True)
    assert Engine.from_pretrained(SMALL_MODEL_DIR, dtype="auto", num_pages=4).model.dtype == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_has_bf16_dot", lambda: False)
    assert Engine.from_pretrained(SMALL_MODEL_DIR, dtype="auto", num_pages=4).model.dtype == torch.float32
    assert Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=4).model.dtype == torch.float32  # the default
