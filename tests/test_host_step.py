"""Per-step host work (issue #18, item 2): a forward chooses its kernels once
(dispatch.select) and agrees with the per-op dispatchers; what a runner keeps
across steps (model.llama.ForwardScratch: each layer's K/V views, the zeroed
attention rows) changes no bit and is made once; the torch attention plans
only the sequences it runs."""
from __future__ import annotations

import pytest
import torch

from agentkv.kernels import dispatch
from agentkv.cache.block_table import BlockTable
from agentkv.cache.pool import PagePool
from agentkv import Engine
from agentkv.engine.runner import ModelRunner
from agentkv.engine.step_item import StepItem
from agentkv.experiments.common import random_model
from agentkv.kernels import cpu_chunk_attention, cpu_fused_ops, cpu_paged_attention, reference
from agentkv.kernels.metadata import AttnMetadata
from agentkv.model.llama import ForwardScratch

PS = 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_chooses_what_the_dispatchers_run(dtype, monkeypatch):
    pool = PagePool(2, 2, 64, 8, PS, dtype, "cpu")
    k_cache = pool.kv[0, 0]
    x = torch.zeros(3, 384, dtype=dtype)
    chosen = dispatch.select(x, k_cache)
    assert chosen is dispatch.select(x, k_cache)  # decided once, then looked up
    if cpu_fused_ops.available():
        assert chosen.rmsnorm is cpu_fused_ops.rmsnorm and chosen.rope_and_store is cpu_fused_ops.rope_and_store
    else:
        assert chosen.rmsnorm is reference.rmsnorm and chosen.rope_and_store is reference.rope_and_store
    if not cpu_paged_attention.available():
        expected = reference.paged_attention
    elif cpu_chunk_attention.available():
        expected = dispatch._cpu_attention_with_chunks
    else:
        expected = cpu_paged_attention.paged_attention
    assert chosen.paged_attention is expected
    monkeypatch.setenv("AGENTKV_KERNELS", "torch")
    forced = dispatch.select(x, k_cache)
    assert forced.paged_attention is reference.paged_attention and forced.rmsnorm is reference.rmsnorm
    assert forced.rope_and_store is reference.rope_and_store
    monkeypatch.setenv("AGENTKV_KERNELS", "cuda")
    with pytest.raises(ValueError, match="AGENTKV_KERNELS"):
        dispatch.select(x, k_cache)


def test_select_follows_a_failed_build(monkeypatch):
    pool = PagePool(1, 2, 64, 4, PS, torch.float32, "cpu")
    monkeypatch.setattr(cpu_paged_attention.extension, "error", "no g++ here")
    monkeypatch.setattr(dispatch, "_warned", [])
    with pytest.warns(RuntimeWarning, match="no g"):
        chosen = dispatch.select(torch.zeros(1, 8), pool.kv[0, 0])
    assert chosen.paged_attention is reference.paged_attention


def _steps(model, runner_scratch: bool) -> list[torch.Tensor]:
    """A decode-heavy run of two sequences through a runner: prefill, single
    decodes (padded to min_rows), a step of both, a verify-sized chunk."""
    pool = PagePool(model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim, 64, PS, model.dtype, "cpu")
    runner = ModelRunner(model, pool)
    if not runner_scratch:
        runner._scratch = None  # the model makes a fresh one every forward
    a, b = BlockTable(pool), BlockTable(pool)
    out = [runner.step([StepItem(a, list(range(3, 30)), 27)])[0]]
    out += runner.step([StepItem(b, list(range(40, 49)), 1)])
    for t in range(6):
        out += runner.step([StepItem(a, [50 + t], 1)])
        out += runner.step([StepItem(a, [60 + t], 1), StepItem(b, [70 + t], 1)])
    out += runner.step([StepItem(b, [5, 6, 7, 8, 9], 5), StepItem(a, [11], 1)])
    if runner_scratch:
        scratch = runner._scratch
        buffers = dict(scratch._attention)
        out += runner.step([StepItem(a, [12], 1)])
        assert len(buffers) == 1  # one width and dtype, grown to the prefill's rows
        assert scratch._attention.keys() == buffers.keys()
        assert all(scratch._attention[k] is v for k, v in buffers.items())
        # Padding rows hold an earlier step's attention rows: finite values,
        # and which ones changes no bit of a real row (the fresh run pads zeros).
        assert all(bool(buf.isfinite().all()) for buf in scratch._attention.values())
    a.release()
    b.release()
    return out


@pytest.mark.parametrize("kernel", ["onednn", "cpp"])  # oneDNN pads a step to 4 rows, the C++ kernel does not
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_scratch_changes_no_bit(dtype, kernel):
    model = random_model("tiny", dtype, seed=3)
    model.prepack(kernel=kernel)
    if model.packed is None or model.packed.kernel != kernel:
        pytest.skip(f"{kernel} linears do not run {dtype} here")
    kept, fresh = _steps(model, True), _steps(model, False)
    assert all(torch.equal(x, y) for x, y in zip(kept, fresh[: len(kept)]))


def test_a_model_shared_by_engines_keeps_a_scratch_per_pool():
    model = random_model("tiny", torch.float32, seed=4)
    e1, e2 = Engine(model, None, page_size=PS, num_pages=32), Engine(model, None, page_size=PS, num_pages=32)
    assert e1.runner._scratch is not e2.runner._scratch
    assert e1.runner._scratch.kv is e1.pool.kv and e2.runner._scratch.kv is e2.pool.kv


def test_reference_plans_only_the_sequences_it_runs():
    pool = PagePool(1, 2, 16, 32, PS, torch.float32, "cpu")
    meta = AttnMetadata.build([1, 9, 2], [7, 20, 10], [[0, 1], [2, 3, 4, 5, 6], [7, 8, 9]], PS)
    q = torch.randn(12, 4, 16)
    k_cache, v_cache = pool.kv[0, 0], pool.kv[0, 1]
    k_cache.normal_()
    v_cache.normal_()
    out = torch.zeros_like(q)
    reference.paged_attention_into(out, q, k_cache, v_cache, meta, 0.25, longer_than=2)
    plan = meta.torch_plans[0, 2]
    assert plan[0] is None and plan[2] is None and plan[1] is not None
    full = reference.paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert torch.equal(out[1:10], full[1:10]) and not out[:1].any() and not out[10:].any()
