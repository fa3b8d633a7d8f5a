"""The dispatch seam: kernels.<op> routes to the Triton module
kernels.triton_<op>, and importing that module leaves the dispatcher alone."""
from __future__ import annotations

import importlib
import types

import pytest
import torch

from agentkv.kernels import dispatch
from agentkv.kernels import cpu_extension, cpu_fused_ops, cpu_layers, cpu_paged_attention, reference
from tests.cpu_kernels import require_built

OPS = ["paged_attention", "rope_and_store", "rmsnorm", "copy_pages", "verify_drafts"]


def test_importing_triton_modules_keeps_dispatchers():
    for op in OPS:
        module = importlib.import_module(f"agentkv.kernels.triton_{op}")
        assert isinstance(module, types.ModuleType) and callable(getattr(module, op))
        assert callable(getattr(dispatch, op)) and not isinstance(getattr(dispatch, op), types.ModuleType)
    assert type(dispatch) is types.ModuleType  # no module-class override


def test_bad_kernels_mode_is_refused(monkeypatch):
    monkeypatch.setenv("AGENTKV_KERNELS", "cuda")
    with pytest.raises(ValueError, match="AGENTKV_KERNELS"):
        dispatch.rmsnorm(torch.ones(1, 4), torch.ones(4), 1e-6)


def test_forced_triton_matches_reference(monkeypatch, device):
    monkeypatch.setenv("AGENTKV_KERNELS", "triton")
    x = torch.randn(3, 40, device=device)
    weight = torch.randn(40, device=device)
    out, _ = dispatch.rmsnorm(x, weight, 1e-6)
    torch.testing.assert_close(out, reference.rmsnorm(x, weight, 1e-6)[0], atol=1e-5, rtol=1e-5)

    logits = torch.randn(3, 20, device=device)
    cu_rows = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    drafts = torch.stack([logits[0].argmax(), logits[0].argmax()]).reshape(2, 1)
    lens = torch.tensor([1, 0], dtype=torch.int32, device=device)
    got = dispatch.verify_drafts(logits, cu_rows, drafts, lens)
    expected = reference.verify_drafts(logits, cu_rows, drafts, lens)
    assert [t.tolist() for t in got] == [t.tolist() for t in expected]


@pytest.mark.parametrize("wins", [True, False])
@pytest.mark.parametrize("isa", cpu_extension.host_isas())
def test_attention_runs_where_it_wins_on_each_isa(isa, wins, monkeypatch):
    # Where bench_cpu_ops finds the torch path faster than the C++ attention
    # on an ISA's build, the torch path runs attention and the layers run in
    # Python; the C++ linears and fused ops still run.
    monkeypatch.setenv("AGENTKV_CPU_ISA", isa)
    monkeypatch.setitem(dispatch.CPP_ATTENTION_WINS, isa, wins)
    cpu_extension.isa()  # the kernels load for the ISA it read last
    require_built(cpu_paged_attention, cpu_fused_ops, cpu_layers)
    x = torch.zeros(2, 64)
    k_cache = torch.zeros(4, 16, 2, 32)
    chosen = dispatch.select(x, k_cache)
    assert (chosen.paged_attention is not reference.paged_attention) == wins
    assert chosen.layer_loop == wins
    assert chosen.rmsnorm is cpu_fused_ops.rmsnorm and chosen.silu_mul is cpu_fused_ops.silu_mul


def test_every_isa_has_an_attention_verdict():
    assert set(cpu_extension.ISA_FLAGS) == set(dispatch.CPP_ATTENTION_WINS)


def test_build_cpu_kernels_names_what_failed_with_a_stubbed_failure(monkeypatch):
    # The real builds are tests/test_kernel_cpu_build.py's; one is made to fail here.
    cpu_extension.isa()
    require_built(*dispatch.CPU_KERNELS)
    assert dispatch.build_cpu_kernels() == {}
    monkeypatch.setattr(cpu_layers.extension, "error", "no g++ here")
    failed = dispatch.build_cpu_kernels()
    assert failed == {"cpu_layers": "no g++ here"}
    assert all(m.extension.available() for m in dispatch.CPU_KERNELS if m is not cpu_layers)
