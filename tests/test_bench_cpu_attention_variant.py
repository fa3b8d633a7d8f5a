"""experiments.benchmarks.bench_cpu_attention --baseline REV builds the decode kernel as
it was at REV beside today's: built from the files of a revision (its source
and the header it includes), it must be today's kernel bit for bit when the
revision is today's. (The option had rotted unseen once: nothing ran it.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentkv.experiments.benchmarks import bench_cpu_attention
from agentkv.kernels import cpu_paged_attention
from tests.cpu_kernels import require_built
from tests.test_kernel_cpu_paged_attention import CASES, build

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _built():
    require_built(cpu_paged_attention)  # a failed build fails on x86

KERNELS = Path(cpu_paged_attention.__file__).parent


def test_a_variant_of_todays_files_is_todays_kernel():
    files = {name: (KERNELS / name).read_text() for name in bench_cpu_attention.KERNEL_FILES}
    variant = bench_cpu_attention.kernel_variant(files)
    for dtype in (torch.float32, torch.bfloat16):
        q, k_cache, v_cache, meta = build(CASES[0], dtype)  # decode steps only
        want = cpu_paged_attention.paged_attention(q, k_cache, v_cache, meta, 0.25)
        assert torch.equal(variant(q, k_cache, v_cache, meta, 0.25), want)


def test_a_revision_gives_the_files_it_has():
    files = bench_cpu_attention.source_at("HEAD")
    assert set(files) == set(bench_cpu_attention.KERNEL_FILES)
    assert "AGENTKV_LIBRARY(agentkv_cpu," in files["cpu_paged_attention.cpp"]


def test_a_revision_before_isa_named_libraries_builds_beside_todays():
    # 602272a registered TORCH_LIBRARY(agentkv_cpu, ...) and had no cpu_library.h.
    files = bench_cpu_attention.source_at("602272a")
    assert "cpu_library.h" not in files
    variant = bench_cpu_attention.kernel_variant(files)
    q, k_cache, v_cache, meta = build(CASES[0], torch.float32)
    want = cpu_paged_attention.paged_attention(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(variant(q, k_cache, v_cache, meta, 0.25), want)
