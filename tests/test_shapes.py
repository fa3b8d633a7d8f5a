"""Shape checkpoints (model/shapes.py): shape:NAME[@SEED] loads a seeded
random-weight model of a real model's published config, with the embedded
default model's tokenizer, wherever a model path is taken (the loader, the
engine, serve.py). Random weights: for serving benchmarks, never answers."""
from __future__ import annotations

import json

import pytest
import torch
import uvicorn

from agentkv import serve
from agentkv.model.dense_forward import dense_hidden, dense_logits
from agentkv.model.errors import ModelLoadError
from agentkv.model.export import export_hf
from agentkv.model.loader import load_model, load_tokenizer
from agentkv.model.shapes import SHAPES, shape_config

# The table's config.json fields and the ModelConfig fields they become.
FIELDS = {
    "model_type": "model_type", "vocab_size": "vocab_size", "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
    "max_position_embeddings": "max_position_embeddings", "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings", "torch_dtype": "torch_dtype",
}
SMALLEST = "smollm2-135m"


def test_the_issues_shapes_are_in_the_table():
    assert {"qwen3-0.6b", "qwen2.5-0.5b", "llama3.2-1b", "smollm2-135m", "smollm2-360m"} <= set(SHAPES)


@pytest.mark.parametrize("name", SHAPES)
def test_each_shapes_config_is_the_tables(name):
    cfg, table = shape_config(name), SHAPES[name]
    assert set(FIELDS) <= set(table)  # every shape names all of them: nothing left to a default
    for key, field in FIELDS.items():
        assert getattr(cfg, field) == table[key], key
    assert cfg.qk_norm == (name.startswith("qwen3"))
    assert cfg.qkv_bias == (table["model_type"] == "qwen2") and not cfg.o_bias and not cfg.mlp_bias
    assert (cfg.rope_scaling or {}).get("rope_type") == (table.get("rope_scaling") or {}).get("rope_type")


@pytest.mark.slow
def test_every_shapes_vocabulary_holds_the_tokenizers_ids():
    tok = load_tokenizer(f"shape:{SMALLEST}")
    assert tok is not None and tok.vocab_size == 49152
    assert all(s["vocab_size"] >= tok.vocab_size for s in SHAPES.values())
    assert load_tokenizer("shape:qwen3-0.6b@5").vocab_size == tok.vocab_size


@pytest.mark.slow
def test_a_shape_loads_with_the_tables_config_and_the_same_weights_every_time():
    first = load_model(f"shape:{SMALLEST}")
    assert first.cfg == shape_config(SMALLEST)
    again = dict(load_model(f"shape:{SMALLEST}@0").named_parameters())
    for name, p in first.named_parameters():
        assert torch.equal(p, again[name]), name
    del again
    other = load_model(f"shape:{SMALLEST}@1", "bfloat16")
    assert other.dtype == torch.bfloat16
    assert not torch.equal(other.embed.float(), first.embed.to(torch.bfloat16).float())


@pytest.mark.parametrize("bad", ["shape:qwen9-1t", "shape:", "shape:smollm2-135m@x"])
def test_a_bad_shape_is_a_clear_error_naming_the_shapes(bad):
    with pytest.raises(ModelLoadError) as err:
        load_model(bad)
    if "@" not in bad:
        assert all(name in str(err.value) for name in SHAPES)
    with pytest.raises(ModelLoadError):
        load_tokenizer(bad)


@pytest.mark.slow
def test_serve_accepts_a_shape_and_serves_it_by_that_name(monkeypatch):
    from fastapi.testclient import TestClient

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append(app))
    serve.serve(["--model", "shape:smollm2-135m", "--kv-cache-gb", "0.02"])
    with TestClient(calls[-1]) as client:
        models = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["shape:smollm2-135m"]



@pytest.mark.slow
def test_a_shape_exports_as_an_hf_checkpoint_that_transformers_runs_alike(tmp_path):
    # A peer that cannot read shape: (vLLM, transformers) gets the same seeded weights, exported once.
    from transformers import AutoModelForCausalLM

    source = f"shape:{SMALLEST}@3"
    out = export_hf(source, tmp_path / "hf", "float32")
    stamp = (out / "export_source.json").stat().st_mtime_ns
    assert export_hf(source, out, "float32") == out and (out / "export_source.json").stat().st_mtime_ns == stamp
    assert json.loads((out / "export_source.json").read_text())["source"] == source
    ours = load_model(source)
    reread = dict(load_model(out).named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, reread[name]), name
    del reread
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ids = torch.tensor([[1, 17, 400, 9, 3000, 52, 7, 7, 801]])
    with torch.no_grad():
        theirs = hf(ids).logits[0]
        mine = dense_logits(ours, dense_hidden(ours, ids))[0]
    torch.testing.assert_close(mine, theirs, atol=2e-4, rtol=0)
    assert export_hf(f"shape:{SMALLEST}@4", tmp_path / "other", "float32") != out  # another seed, another export
