"""Triton verify_drafts against the torch reference, and the reference's
sampling rule against the target distribution."""
from __future__ import annotations

import pytest
import torch

from agentkv.kernels import reference
from agentkv.kernels.triton_verify_drafts import verify_drafts

# (vocab, draft lens): V above one 4096-lane block exercises the chunked scans.
SHAPES = [(50, [0, 1, 3, 4, 2]), (10000, [4, 0, 2, 3])]


def layout(draft_lens: list[int], max_drafts: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    cu = [0]
    for n in draft_lens:
        cu.append(cu[-1] + n + 1)
    lens = torch.tensor(draft_lens, dtype=torch.int32, device=device)
    return torch.tensor(cu, dtype=torch.int32, device=device), lens


def check_equal(got, expected) -> None:
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int64
    assert got[0].tolist() == expected[0].tolist()
    assert got[1].tolist() == expected[1].tolist()


@pytest.mark.parametrize("vocab, draft_lens", SHAPES, ids=["V50", "V10000"])
def test_greedy_matches_reference(vocab, draft_lens, device):
    """Random logits with planted matches, so acceptance stops at every depth."""
    g = torch.Generator().manual_seed(0)
    max_drafts = max(draft_lens)
    cu_rows, lens = layout(draft_lens, max_drafts, device)
    logits = torch.randn(int(cu_rows[-1]), vocab, generator=g)
    drafts = torch.randint(vocab, (len(draft_lens), max_drafts), generator=g)
    for i, n in enumerate(draft_lens):
        keep = int(torch.randint(n + 1, (1,), generator=g))  # drafts [0, keep) match
        for j in range(keep):
            drafts[i, j] = logits[int(cu_rows[i]) + j].argmax()
    # Ties: the lowest index wins, inside a block and across blocks.
    logits[0, 7] = logits[0, vocab - 1] = 100.0
    logits[1, 3] = logits[1, 5] = 100.0
    drafts[1, 0] = 3
    args = (logits.to(device), cu_rows, drafts.to(device), lens)
    check_equal(verify_drafts(*args), reference.verify_drafts(*args))


def test_greedy_bf16_logits(device):
    g = torch.Generator().manual_seed(1)
    cu_rows, lens = layout([2, 1], 2, device)
    logits = torch.randn(5, 300, generator=g).to(device, torch.bfloat16)
    drafts = logits.float().argmax(-1)[[0, 3]].reshape(2, 1).repeat(1, 2).to(device)
    args = (logits, cu_rows, drafts, lens)
    check_equal(verify_drafts(*args), reference.verify_drafts(*args))


def dyadic_probs(planted: torch.Tensor, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Rows of multiples of 2**-10 summing to exactly 1, half the mass or more on
    the planted token: every CDF is exact in any summation order, so kernel
    and reference must agree token for token, and drafts of the planted
    tokens are accepted often enough to reach every depth."""
    rows = planted.shape[0]
    counts = torch.multinomial(torch.rand(rows, vocab, generator=g) ** 4, 512, replacement=True, generator=g)
    hist = torch.zeros(rows, vocab).scatter_add_(1, counts, torch.ones(rows, 512))
    hist[torch.arange(rows), planted] += 512
    return hist / 1024


@pytest.mark.parametrize("vocab, draft_lens", SHAPES, ids=["V50", "V10000"])
def test_sampling_matches_reference(vocab, draft_lens, device):
    g = torch.Generator().manual_seed(2)
    max_drafts = max(draft_lens)
    cu_rows, lens = layout(draft_lens, max_drafts, device)
    planted = torch.randint(vocab, (int(cu_rows[-1]),), generator=g)
    probs = dyadic_probs(planted, vocab, g)
    drafts = torch.randint(vocab, (len(draft_lens), max_drafts), generator=g)
    for i, n in enumerate(draft_lens):
        drafts[i, :n] = planted[int(cu_rows[i]) : int(cu_rows[i]) + n]
    accepted = set()
    for trial in range(6):
        uniforms = torch.rand(len(draft_lens), max_drafts + 1, generator=g)
        args = (probs.to(device), cu_rows, drafts.to(device), lens, uniforms.to(device))
        expected = reference.verify_drafts(*args)
        check_equal(verify_drafts(*args), expected)
        accepted.update(expected[0].tolist())
    assert len(accepted) >= 3  # rejections at several depths as well as full acceptance


def test_sampling_by_hand(device):
    """p = [1/2, 1/4, 0, 1/4] at every row, drafts [3, 0]."""
    probs = torch.tensor([[0.5, 0.25, 0.0, 0.25]] * 6, device=device)
    cu_rows, lens = layout([2, 2], 2, device)
    drafts = torch.tensor([[3, 0], [3, 0]], device=device)
    uniforms = torch.tensor(
        [
            # u_0 = 0.9 >= p(3) rejects; residual [1/2, 1/4, 0, 0], threshold 0.9 - 0.25 = 0.65 -> token 1.
            [0.9, 0.0, 0.0],
            # Both accepted (0.1 < 1/4, 0.3 < 1/2); row 2 draws with u = 0.6 -> token 1.
            [0.1, 0.3, 0.6],
        ],
        device=device,
    )
    args = (probs, cu_rows, drafts, lens, uniforms)
    for num_accepted, next_token in (verify_drafts(*args), reference.verify_drafts(*args)):
        assert num_accepted.tolist() == [0, 2] and next_token.tolist() == [1, 1]


def test_degenerate_zero_row(device):
    """No mass to draw from: both fall back to token 0 rather than run off the row."""
    probs = torch.zeros(1, 7, device=device)
    cu_rows, lens = layout([0], 1, device)
    args = (probs, cu_rows, torch.zeros(1, 1, dtype=torch.int64, device=device), lens, torch.full((1, 2), 0.5, device=device))
    check_equal(verify_drafts(*args), reference.verify_drafts(*args))
    assert verify_drafts(*args)[1].tolist() == [0]


def test_empty_drafts_draw_like_a_decode_step(device):
    """With no drafts the token is the plain inverse-CDF draw of row 0."""
    probs = torch.tensor([[0.25, 0.5, 0.25]] * 3, device=device)
    cu_rows, lens = layout([0, 0, 0], 1, device)
    drafts = torch.zeros(3, 1, dtype=torch.int64, device=device)
    uniforms = torch.tensor([[0.2, 0.0], [0.5, 0.0], [0.75, 0.0]], device=device)
    num_accepted, next_token = verify_drafts(probs, cu_rows, drafts, lens, uniforms)
    assert num_accepted.tolist() == [0, 0, 0] and next_token.tolist() == [0, 1, 2]


def test_reference_first_token_has_target_distribution():
    """Speculative sampling is exact: the first emitted token (the draft if
    accepted, else the residual draw) is distributed as the target's p_0,
    whatever the drafts are."""
    g = torch.Generator().manual_seed(3)
    trials, vocab, k = 4000, 5, 2
    p = torch.tensor([0.1, 0.35, 0.05, 0.3, 0.2])
    probs = p.repeat(trials * (k + 1), 1)
    cu_rows = torch.arange(0, trials * (k + 1) + 1, k + 1, dtype=torch.int32)
    # Skewed drafts: under uniformly random drafts even the naive rule (redraw
    # from p on rejection) would come out unbiased and pass.
    drafts = torch.where(torch.rand(trials, k, generator=g) < 0.7, 1, 2)
    uniforms = torch.rand(trials, k + 1, generator=g)
    num_accepted, next_token = reference.verify_drafts(
        probs, cu_rows, drafts, torch.full((trials,), k, dtype=torch.int32), uniforms
    )
    first = torch.where(num_accepted > 0, drafts[:, 0], next_token)
    observed = torch.bincount(first, minlength=vocab).double()
    expected = p.double() * trials
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 18.47, chi2  # the 0.999 quantile of chi-square with vocab - 1 = 4 dof
