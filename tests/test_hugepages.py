"""cache.hugepages: zeroed tensors on 2 MB-aligned, huge-page-advised memory,
the same tensor as torch.zeros wherever the advice cannot be given."""
from __future__ import annotations

import mmap
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from agentkv.cache import hugepages
from agentkv.cache.pool import PagePool


def anon_huge_kb() -> int:
    return sum(int(kb) for kb in re.findall(r"AnonHugePages:\s+(\d+) kB", Path("/proc/self/smaps").read_text()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 3), (3, 2, 1 << 20), (hugepages.MIN_BYTES // 4 + 7,)])
def test_zeros_is_torch_zeros(shape, dtype):
    x = hugepages.zeros(shape, dtype)
    assert x.shape == shape and x.dtype == dtype and x.is_contiguous()
    assert torch.equal(x, torch.zeros(shape, dtype=dtype))
    x.fill_(1)  # writable over its whole extent
    assert bool((x == 1).all())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_large_tensors_start_on_a_huge_page():
    x = hugepages.zeros((hugepages.MIN_BYTES,), torch.uint8)
    assert x.data_ptr() % hugepages.HUGE_PAGE == 0
    small = hugepages.zeros((1000,), torch.float32)  # below MIN_BYTES: plain torch.zeros, no 2 MB rounding
    assert small.untyped_storage().nbytes() == 4000


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
    reason="no transparent huge pages here",
)
def test_the_advice_gives_huge_pages():
    before = anon_huge_kb()
    x = hugepages.zeros((8 * hugepages.HUGE_PAGE,), torch.uint8)
    # The kernel may refuse a page it cannot find free 2 MB for; most of them come huge.
    assert anon_huge_kb() - before >= 4 * hugepages.HUGE_PAGE // 1024
    del x


def test_without_madvise_it_is_plain_zeros(monkeypatch):
    monkeypatch.setattr(hugepages, "_CAN_ADVISE", False)  # as on a platform without madvise
    x = hugepages.zeros((hugepages.MIN_BYTES // 4,), torch.float32)
    assert torch.equal(x, torch.zeros_like(x))
    assert x.untyped_storage().nbytes() == hugepages.MIN_BYTES  # not the over-allocated, aligned mapping


@pytest.mark.skipif(not hugepages._CAN_ADVISE, reason="no madvise to refuse")
def test_a_refused_advice_still_gives_the_tensor(monkeypatch):
    class Refusing(mmap.mmap):  # as a kernel without THP answers
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(hugepages, "mmap", types.SimpleNamespace(**{**vars(mmap), "mmap": Refusing}))
    x = hugepages.zeros((3, hugepages.MIN_BYTES), torch.bfloat16)
    assert x.shape == (3, hugepages.MIN_BYTES) and not x.any()


def test_non_cpu_devices_get_torch_zeros():
    x = hugepages.zeros((hugepages.MIN_BYTES,), torch.uint8, device="meta")
    assert x.device.type == "meta" and x.shape == (hugepages.MIN_BYTES,)


def test_pool_storage_is_huge_page_aligned_and_zero():
    pool = PagePool(4, 2, 64, 512, 16, torch.bfloat16)  # 16 MB of KV
    assert pool.kv.data_ptr() % hugepages.HUGE_PAGE == 0 or not sys.platform.startswith("linux")
    assert not pool.kv.any()
