"""Zeroed CPU tensors on transparent huge pages (2 MB), where the OS offers them.

The KV pool is read front to back every decode step. On 4 KB pages a head's
stream crosses a page every 4 KB (every 32 keys of a bf16 head of 64), and
each crossing costs a TLB walk and restarts the hardware prefetchers, which
do not cross pages. Linux with THP set to `madvise` (the default on many
distributions) backs memory with 2 MB pages only where it was asked to by
madvise(MADV_HUGEPAGE); torch's allocator does not ask unless
THP_MEM_ALLOC_ENABLE=1 is set before it starts, and memory it reuses from
the heap is already on small pages. So the buffer is a fresh private
anonymous mapping, cut at a 2 MB boundary, advised, and only then written
(the first touch is what allocates the pages).

Where the advice cannot be given (not Linux, THP off), the same zeroed tensor
comes back on ordinary pages: huge pages are a speed-up, never a requirement.
"""
from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20
# Below this a tensor spans a few pages anyway, and rounding it up to 2 MB
# would only waste memory.
MIN_BYTES = 4 * HUGE_PAGE

_CAN_ADVISE = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype, device=device); a large CPU tensor
    starts on a 2 MB boundary of memory advised to huge pages."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < MIN_BYTES or not _CAN_ADVISE:
        return torch.zeros(shape, dtype=dtype, device=device)
    # MAP_PRIVATE: a shared anonymous mapping is shmem, whose huge pages
    # follow another setting. The tensor keeps the mapping alive.
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(area, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    try:
        area.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # THP compiled out or off: ordinary pages, the same tensor
        pass
    buf = raw[offset : offset + nbytes]
    buf.zero_()  # fault every page in now, as torch.zeros does
    return buf.view(dtype).view(shape)
