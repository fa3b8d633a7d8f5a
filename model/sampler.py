"""Logits -> probabilities -> tokens.

The distribution and the draw are separate functions because speculative
verification needs both: it compares the target's probabilities with the
draft's, and it must be able to reproduce the exact token a plain decode step
would have drawn from the same uniform.

A draw is inverse-CDF sampling with one uniform per row, taken from that
row's own CPU generator. Generators live on the CPU whatever the logits'
device, so a seeded sequence draws the same uniforms on CPU and CUDA, and
never depends on which other sequences share its batch.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens, and when it stops.

    temperature 0 is greedy. top_k <= 0, top_p == 1 and min_p == 0 switch the
    respective filter off. stop_token_ids and stop may be given as any
    iterable (a bare string counts as one stop string); they are stored as
    tuples so params stay hashable.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

        if not _is_real(self.temperature) or not (0.0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < 2**64)):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(x: object) -> bool:
    # bool is an int subclass; True as a top_k is a bug, not a 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one sequence; an unseeded one still gets its own
    random seed so that no two sequences share a stream by accident."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from: [N, V] logits -> [N, V] fp32 probs.

    Filters apply in order, each to what the previous one left:
    temperature, top-k (the k highest, lowest index first on ties), top-p (the
    smallest prefix by descending probability whose mass >= top_p), min_p
    (tokens with p >= min_p * max p). The most likely token always survives.
    Greedy params give the one-hot of the argmax, the limit as temperature -> 0.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if not (0 < params.top_k < vocab or params.top_p < 1.0 or params.min_p > 0.0):
        return torch.softmax(logits, dim=-1)

    # All three filters are prefixes of the descending order, so decide them
    # on sorted logits and scatter the survivors back once.
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if 0 < params.top_k < vocab:
        keep[:, params.top_k :] = False
    if params.top_p < 1.0:
        p = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
        mass_before = torch.cumsum(p, dim=-1) - p
        keep &= mass_before < params.top_p
    if params.min_p > 0.0:
        p = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
        keep &= p >= params.min_p * p[:, :1]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def draw_uniforms(generators: Sequence[torch.Generator] | None, n: int) -> torch.Tensor:
    """One U[0, 1) per row, row i from generators[i] (the global RNG if None)."""
    if generators is None:
        return torch.rand(n)
    if len(generators) != n:
        raise ValueError(f"need one generator per row: {n} rows, {len(generators)} generators")
    return torch.cat([torch.rand(1, generator=g) for g in generators])


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: row i's token is the first index whose cumulative mass
    exceeds uniforms[i] * (row total). Zero-probability tokens are never
    chosen: their CDF step is flat, so an earlier index always wins."""
    # fp64 so that u < 1 (a multiple of 2**-24) times the total can never
    # round up to the total and run off the end of the CDF.
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = uniforms.to(device=cdf.device, dtype=torch.float64) * cdf[:, -1]
    return torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generators: Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """[N, V] logits -> [N] token ids. Greedy takes the argmax (lowest index on
    ties) and consumes no randomness; otherwise each row spends exactly one
    uniform from its own generator."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = probs_from_logits(logits, params)
    return sample_from_probs(probs, draw_uniforms(generators, logits.shape[0]))
