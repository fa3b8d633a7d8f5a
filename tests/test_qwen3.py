"""Qwen3 (per-head q/k RMSNorm before RoPE, head_dim given apart from
hidden / heads) against transformers' Qwen3ForCausalLM on seeded random
weights: fp32 logits on the torch path and on the C++ one (its layer loop
included), the dense training forward, greedy tokens over a long prompt
through the paged cache with and without speculation, and GGUF files written
by the `gguf` package holding the safetensors checkpoint's weights."""
from __future__ import annotations

import pytest
import torch

from agentkv import Engine
from agentkv.kernels import cpu_layers, dispatch
from agentkv.model.config import ModelConfig
from agentkv.model.dense_forward import dense_hidden, dense_logits
from agentkv.model.loader import load_model
from tests.hf_models import make_hf_model
from tests.test_speculation import StubDrafter

NAME = "qwen3-qknorm"
VOCAB = 320
ATOL = 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    return make_hf_model(NAME, path, seed=7), path


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def random_ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_and_norms_are_the_checkpoints(pair):
    hf, path = pair
    cfg = ModelConfig.from_dir(path)
    assert cfg.model_type == "qwen3" and cfg.qk_norm and cfg.head_dim == 32 != cfg.hidden_size // cfg.num_heads
    assert not cfg.qkv_bias and not cfg.o_bias and set(cfg.sliding_windows) == {0}
    model = load_model(path)
    for ours, theirs in zip(model.blocks, hf.model.layers):
        assert torch.equal(ours.attn.q_norm, theirs.self_attn.q_norm.weight)
        assert torch.equal(ours.attn.k_norm, theirs.self_attn.k_norm.weight)
    assert not torch.equal(model.blocks[0].attn.q_norm, model.blocks[0].attn.k_norm)  # random, not ones


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_logits_match_transformers(pair, kernels, monkeypatch):
    """Uneven appends: prefill chunks longer than the C++ attention takes (the
    Python layers) and short ones (the C++ layer loop, where it builds)."""
    hf, path = pair
    monkeypatch.setenv("AGENTKV_KERNELS", kernels)
    engine = Engine.from_pretrained(path, page_size=8, num_pages=64)
    ids = random_ids(1, 90)
    chunks = [40, 1, 7, 3, 17, 1, 21]
    assert sum(chunks) == len(ids)
    looped = []
    real = cpu_layers.forward
    monkeypatch.setattr(cpu_layers, "forward", lambda *a: looped.append(1) or real(*a))
    with engine.session() as s:
        outs, start = [], 0
        for n in chunks:
            outs.append(s.append(ids[start : start + n], all_logits=True))
            start += n
    torch.testing.assert_close(torch.cat(outs), hf_logits(hf, ids), atol=ATOL, rtol=0)
    kv = torch.zeros(1, 8, 2, 32)
    loop_builds = dispatch.select(kv, kv).layer_loop and getattr(engine.model.packed, "kernel", None) == "cpp"
    assert bool(looped) == (kernels == "auto" and loop_builds)


def test_dense_training_forward_matches_transformers(pair):
    hf, path = pair
    model = load_model(path)
    ids = random_ids(2, 33)
    with torch.no_grad():
        ours = dense_logits(model, dense_hidden(model, torch.tensor([ids])))[0]
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=ATOL, rtol=0)


def long_prompt(seed: int) -> list[int]:
    """A few hundred tokens with copied spans, so the n-gram drafter finds drafts."""
    base = random_ids(seed, 240)
    return base + base[10:40] + base[100:130] + base[50:70]


class HalfRightDrafter(StubDrafter):
    """Drafts transformers' own next tokens, a growing run of them then one
    wrong token: drafts accepted in part, rejected in part."""

    def __init__(self, session, prompt_len: int, truth: list[int]):
        self.session, self.prompt_len, self.truth, self.calls = session, prompt_len, truth, 0

    def propose(self, k: int, shared: bool = True) -> list[int]:
        self.calls += 1
        done = len(self.session) - self.prompt_len
        right = self.calls % (k + 1)
        wrong = [(self.truth[done + right] + 1) % VOCAB] if done + right < len(self.truth) else []
        return (self.truth[done : done + right] + wrong)[:k]


@pytest.mark.parametrize("seed", range(2))
def test_greedy_over_a_long_prompt_matches_transformers_with_and_without_speculation(pair, seed):
    hf, path = pair
    prompt = long_prompt(seed)
    new = 40
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    ref = ref[0, len(prompt):].tolist()
    engine = Engine.from_pretrained(path, page_size=8, num_pages=128, drafter="ngram")
    for drafts in ("none", "ngram", "half-right"):
        with engine.session() as s:
            s.append(prompt)
            if drafts == "half-right":
                s.use_drafter(HalfRightDrafter(s, len(prompt), ref))
            out = s.generate(max_tokens=new, temperature=0.0, ignore_eos=True, speculative=drafts != "none")
            stats = engine.stats[-1]
            assert s.tokens == prompt + out
        assert out == ref, drafts
        if drafts == "none":
            assert stats.drafted_tokens == 0
        elif drafts == "ngram":  # the prompt's copied spans: drafts verified (random weights mostly reject them)
            assert stats.drafted_tokens > 0
        else:
            assert 0 < stats.accepted_tokens < stats.drafted_tokens


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_round_trip_holds_the_safetensors_weights(pair, qtype, tmp_path):
    pytest.importorskip("gguf")
    from tests.gguf_files import write_gguf

    hf, path = pair
    file = write_gguf(hf, tmp_path / f"qwen3-{qtype}.gguf", qtype, arch="qwen3")
    ours, want = load_model(file), load_model(path)
    assert ours.cfg.rms_norm_eps == pytest.approx(want.cfg.rms_norm_eps)  # stored as float32
    assert ours.cfg == ModelConfig(**{**want.cfg.__dict__, "bos_token_id": 1, "eos_token_ids": (2,),
                                      "torch_dtype": "float32", "rms_norm_eps": ours.cfg.rms_norm_eps})
    got, expected = dict(ours.named_parameters()), dict(want.named_parameters())
    assert got.keys() == expected.keys()
    for name, p in expected.items():
        if qtype == "F32" or p.dim() == 1:  # norms stay F32 in every file
            assert torch.equal(got[name], p), name
        else:
            torch.testing.assert_close(got[name], p, atol=0.02 * p.abs().max().item(), rtol=0)
    if qtype == "F32":  # the file's tokenizer (the embedded one) is not this model's: none
        engine = Engine(ours, None, page_size=8, num_pages=32)
        ids = random_ids(3, 50)
        with engine.session() as s:
            torch.testing.assert_close(s.append(ids, all_logits=True), hf_logits(hf, ids), atol=ATOL, rtol=0)
