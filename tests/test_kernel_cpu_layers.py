"""The C++ layer loop (kernels/cpu_layers.py) against the Python loop of
model/llama.py: the same logits and K/V bits over decode, verify, prefill
chunks and mixed steps, ragged batches, GQA, sliding windows, biases, tied
embeddings and Qwen3's per-head q/k norms, in fp32 and bf16; the fallback
when it cannot build; bad input."""
from __future__ import annotations

import warnings

import pytest
import torch

from agentkv.kernels import dispatch
from agentkv.kernels import cpu_fused_ops, cpu_layers, cpu_linear, cpu_paged_attention
from agentkv.kernels.metadata import AttnMetadata
from agentkv.model import llama
from agentkv.model.config import ModelConfig
from agentkv.model.default import random_init
from agentkv.model.llama import ForwardScratch, Transformer
from tests.cpu_kernels import built_on_each_isa
from tests.test_kernel_cpu_linear import needs

# Every test on each vector ISA this CPU runs, with its kernels built for it (a failed build fails on x86).
_built = built_on_each_isa(cpu_layers, cpu_linear, cpu_fused_ops, cpu_paged_attention)

PS = 8  # page size
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# (qkv bias, o bias, mlp bias, sliding windows, tied, q/k norms): Llama,
# Qwen2 (qkv bias, tied), Mistral-like windows on some layers, every bias,
# Qwen3 (q/k norms).
MODELS = {
    "llama": (False, False, False, (0, 0, 0), False, False),
    "qwen2": (True, False, False, (0, 0, 0), True, False),
    "windows": (False, False, False, (5, 0, 12), False, False),
    "biases": (True, True, True, (0, 7, 0), True, False),
    "qwen3": (False, False, False, (0, 0, 0), True, True),
}


def model_of(name: str, dtype: torch.dtype) -> Transformer:
    qkv_bias, o_bias, mlp_bias, windows, tied, qk_norm = MODELS[name]
    cfg = ModelConfig(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
        max_position_embeddings=512, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias, sliding_windows=windows,
        tie_word_embeddings=tied, qk_norm=qk_norm,
    )
    model = Transformer(cfg, dtype)
    random_init(model, 5)
    with torch.no_grad():  # norms off one, so that a swapped norm weight shows
        for b in model.blocks:
            b.attn_norm.add_(torch.linspace(-0.3, 0.3, 64).to(dtype))
            b.mlp_norm.sub_(torch.linspace(-0.2, 0.2, 64).to(dtype))
            if qk_norm:
                b.attn.q_norm.add_(torch.linspace(-0.4, 0.4, 16).to(dtype))
                b.attn.k_norm.sub_(torch.linspace(-0.3, 0.3, 16).to(dtype))
    model.prepack()
    needs(dtype)
    assert model.packed is not None and model.packed.kernel == "cpp"
    assert dispatch.select(torch.zeros(1, dtype=dtype), torch.zeros(1, PS, 2, 16, dtype=dtype)).layer_loop
    return model


class Steps:
    """Sequences of a pool stepped through the model, each step once by the
    C++ loop and once by the Python loop on a copy of the pool."""

    def __init__(self, model: Transformer, num_seqs: int):
        cfg = model.cfg
        self.model = model
        self.kv = torch.zeros(cfg.num_layers, 2, 64, PS, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
        self.kv_py = self.kv.clone()
        self.scratch, self.scratch_py = ForwardScratch(self.kv), ForwardScratch(self.kv_py)
        self.lens = [0] * num_seqs
        # Pages scattered over the pool, sequence by sequence.
        self.tables = [[(7 * (s * 8 + i) + 3) % 64 for i in range(8)] for s in range(num_seqs)]
        self.gen = torch.Generator().manual_seed(11)

    def step(self, query_lens: list[int], monkeypatch, pad: int = 0, logit_indices=None) -> tuple:
        """(C++ logits, Python logits, whether the C++ loop ran)."""
        self.lens = [n + q for n, q in zip(self.lens, query_lens)]
        live = [i for i, q in enumerate(query_lens) if q]
        meta = AttnMetadata.build(
            [query_lens[i] for i in live], [self.lens[i] for i in live], [self.tables[i] for i in live], PS
        )
        ids = torch.randint(0, self.model.cfg.vocab_size, (meta.num_tokens + pad,), generator=self.gen)
        ran = []
        real = cpu_layers.forward
        monkeypatch.setattr(cpu_layers, "forward", lambda *a: ran.append(1) or real(*a))
        got = self.model(ids, meta, self.kv, logit_indices, self.scratch)
        monkeypatch.setattr(cpu_layers, "runs", lambda meta, dtype: False)
        want = self.model(ids, meta, self.kv_py, logit_indices, self.scratch_py)
        monkeypatch.undo()
        return got, want, bool(ran)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", MODELS)
def test_loop_gives_the_python_loops_bits(name, dtype, monkeypatch):
    steps = Steps(model_of(name, dtype), 3)
    limit = cpu_paged_attention.MAX_QUERIES[dtype]
    plan = [
        ([9, 20, 3], True),  # ragged prefill chunks within the C++ attention's limit
        ([1, 1, 1], True),  # decode
        ([5, 1, 3], True),  # verify-shaped
        ([0, 1, 0], True),  # one sequence alone
        ([limit + 3, 1, 2], False),  # a long chunk: the Python loop, the reference attention
        ([1, 2, 1], True),
    ]
    for query_lens, in_cpp in plan:
        got, want, ran = steps.step(query_lens, monkeypatch)
        assert ran == in_cpp, query_lens
        assert got.dtype == torch.float32 and same(got, want), query_lens
        assert torch.equal(steps.kv, steps.kv_py), query_lens


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_padding_rows_and_logit_indices(dtype, monkeypatch):
    steps = Steps(model_of("biases", dtype), 2)
    steps.step([6, 4], monkeypatch)
    got, want, ran = steps.step([1, 1], monkeypatch, pad=3)
    assert ran and got.shape[0] == 2 and same(got, want)
    got, want, ran = steps.step([3, 2], monkeypatch, logit_indices=torch.tensor([2, 4]))
    assert ran and got.shape[0] == 2 and same(got, want)
    got, want, ran = steps.step([2, 1], monkeypatch, pad=2, logit_indices=torch.tensor([1, 2]))
    assert ran and same(got, want) and torch.equal(steps.kv, steps.kv_py)


def test_weights_written_in_place_are_seen(monkeypatch):
    """As PackedWeights repacks after a write in place, the loop is made again."""
    model = model_of("qwen2", torch.float32)
    steps = Steps(model, 1)
    first, _, _ = steps.step([4], monkeypatch)
    loop = steps.scratch.layer_loop(model)
    assert steps.scratch.layer_loop(model) is loop  # kept while nothing changes
    random_init(model, 9)
    assert steps.scratch.layer_loop(model) is not loop
    got, want, ran = steps.step([2], monkeypatch)
    assert ran and same(got, want)
    model.prepack(False)  # plain matmuls: no loop
    assert steps.scratch.layer_loop(model) is None


def test_a_pools_first_loop_tunes_the_attentions_prefetch_on_its_pages(monkeypatch):
    model = model_of("llama", torch.float32)
    steps = Steps(model, 1)
    calls = []
    monkeypatch.setattr(cpu_paged_attention, "tune_prefetch", lambda caches, heads: calls.append((caches, heads)))
    loop = steps.scratch.layer_loop(model)
    assert len(calls) == 1 and calls[0][1] == model.cfg.num_heads
    assert [(k.data_ptr(), v.data_ptr()) for k, v in calls[0][0]] == [
        (k.data_ptr(), v.data_ptr()) for k, v in steps.scratch.layers
    ]
    random_init(model, 9)  # the loop is made again, over the same pool: not timed again
    assert steps.scratch.layer_loop(model) is not loop and len(calls) == 1


def test_a_failed_build_keeps_the_python_loop_with_one_warning(monkeypatch):
    model = model_of("llama", torch.float32)
    steps = Steps(model, 2)
    monkeypatch.setattr(cpu_layers.extension, "error", "no g++ here")
    monkeypatch.setattr(dispatch, "_warned_layers", [])
    x, k_cache = torch.zeros(1), steps.kv[0, 0]
    with pytest.warns(RuntimeWarning, match="no g\\+\\+ here"):
        assert not dispatch.select(x, k_cache).layer_loop
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not dispatch.select(x, k_cache).layer_loop  # warned once
        meta = AttnMetadata.build([3, 1], [3, 1], steps.tables[:2], PS)
        ids = torch.arange(4)
        kv_py = steps.kv.clone()
        got = model(ids, meta, steps.kv)
    monkeypatch.undo()
    assert dispatch.select(x, k_cache).layer_loop  # built again: the loop runs
    assert same(got, model(ids, meta, kv_py)) and torch.equal(steps.kv, kv_py)


def test_a_changed_op_keeps_the_python_loop_with_one_warning(monkeypatch):
    model = model_of("llama", torch.float32)
    steps = Steps(model, 1)

    def fails(*args):
        raise RuntimeError("Tried to access or call an operator with a wrong signature")

    monkeypatch.setattr(cpu_layers, "make", fails)
    monkeypatch.setattr(llama, "_warned_loop", [])
    with pytest.warns(RuntimeWarning, match="wrong signature"):
        assert steps.scratch.layer_loop(model) is None
    got, want, ran = steps.step([3], monkeypatch)
    assert not ran and same(got, want)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_bad_input_raises_and_changes_nothing(dtype, monkeypatch):
    model = model_of("windows", dtype)
    steps = Steps(model, 2)
    steps.step([5, 3], monkeypatch)
    before = steps.kv.clone()
    loop = steps.scratch.layer_loop(model)
    ids = torch.tensor([1, 2])
    o_rows, _ = steps.scratch.attention_rows(2, 2, 4, 16, dtype)
    meta = AttnMetadata.build([1, 1], [6, 4], steps.tables[:2], PS)
    bad_slot = AttnMetadata.build([1, 1], [6, 4], steps.tables[:2], PS)
    bad_slot.slot_mapping[1] = steps.kv.shape[2] * PS
    with pytest.raises(IndexError, match="slot"):
        cpu_layers.forward(loop, ids, o_rows, bad_slot, None)
    bad_pos = AttnMetadata.build([1, 1], [6, 4], steps.tables[:2], PS)
    bad_pos.positions[0] = model.cfg.max_position_embeddings
    with pytest.raises(IndexError, match="position"):
        model(torch.tensor([1, 2]), bad_pos, steps.kv, None, steps.scratch)
    with pytest.raises(ValueError, match="o_rows"):
        cpu_layers.forward(loop, ids, o_rows[:, :32], meta, None)
    with pytest.raises(ValueError, match="ids must be"):
        cpu_layers.forward(loop, ids[:1], o_rows[:1], meta, None)
    with pytest.raises(IndexError):  # an id past the vocabulary: the lookup stops the step before any write
        cpu_layers.forward(loop, torch.tensor([1, model.cfg.vocab_size]), o_rows, meta, None)
    assert torch.equal(steps.kv, before)
    with pytest.raises(ValueError, match="one \\(K, V\\) pair per layer"):
        cpu_layers.make([], [], 4, 2, 16, 1e-6, model.embed, model.cos, model.sin, model.norm,
                        cpu_linear.pack(model.lm_head))
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        llama._make_loop(model, model.packed, [(k[:, :, :1], v[:, :, :1]) for k, v in steps.scratch.layers])
