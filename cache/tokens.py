"""Comparing token runs: conversations share long prefixes, so compare in strides first."""
from __future__ import annotations

from typing import Sequence

STRIDE = 256


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of a and b."""
    n = min(len(a), len(b))
    i = 0
    while i + STRIDE <= n and a[i : i + STRIDE] == b[i : i + STRIDE]:
        i += STRIDE
    while i < n and a[i] == b[i]:
        i += 1
    return i
