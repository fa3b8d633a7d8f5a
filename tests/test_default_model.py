"""The shipped small model (models/agent-8m): transformers loads it and agrees with the engine,
and the engine's own chat template renders tool calls it can parse."""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentkv import Engine
from agentkv.model.default import SMALL_MODEL_DIR, small_model_dir


def test_transformers_loads_the_default_checkpoint_with_matching_logits():
    path = small_model_dir()
    engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=64)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "List the files under src/ and read src/config.py"}]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    theirs = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids == list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    with engine.session() as s:
        ours = s.append(ids, all_logits=True)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
