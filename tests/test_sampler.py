import math

import pytest
import torch

from agentkv.model.sampler import (
    SamplingParams,
    draw_uniforms,
    make_generator,
    probs_from_logits,
    sample,
    sample_from_probs,
)


def reference_probs(row: list[float], params: SamplingParams) -> list[float]:
    """The filters written out plainly for one row, in float64."""
    vocab = len(row)
    if params.temperature == 0:
        best = max(range(vocab), key=lambda i: (row[i], -i))
        return [1.0 if i == best else 0.0 for i in range(vocab)]
    z = [x / params.temperature for x in row]

    def softmax(kept: list[int]) -> dict[int, float]:
        top = max(z[i] for i in kept)
        e = {i: math.exp(z[i] - top) for i in kept}
        total = sum(e.values())
        return {i: v / total for i, v in e.items()}

    kept = sorted(range(vocab), key=lambda i: -z[i])  # stable: lower index first on ties
    if 0 < params.top_k < vocab:
        kept = kept[: params.top_k]
    if params.top_p < 1.0:
        p = softmax(kept)
        nucleus, mass = [], 0.0
        for i in kept:
            nucleus.append(i)
            mass += p[i]
            if mass >= params.top_p:
                break
        kept = nucleus
    if params.min_p > 0.0:
        p = softmax(kept)
        p_max = max(p.values())
        kept = [i for i in kept if p[i] >= params.min_p * p_max]
    p = softmax(kept)
    return [p.get(i, 0.0) for i in range(vocab)]


def make_logits(rows: int = 8, vocab: int = 37, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    smooth = torch.randn(rows, vocab, generator=g) * 2
    # Integer-valued rows are full of ties, where the tie-breaking rule shows.
    tied = torch.randint(-2, 3, (rows, vocab), generator=g).float()
    return torch.cat([smooth, tied])


FILTERS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.3),
    SamplingParams(temperature=2.5),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_k=36),
    SamplingParams(temperature=1.0, top_k=-1),
    SamplingParams(temperature=0.7, top_p=0.3),
    SamplingParams(temperature=1.0, top_p=0.75),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.5),
    SamplingParams(temperature=1.0, min_p=1.0),
    # top_p values stay off multiples of 1/k, where the tied rows would put the
    # nucleus edge exactly on a rounding boundary of fp32 vs fp64 sums.
    SamplingParams(temperature=0.8, top_k=10, top_p=0.83, min_p=0.1),
    SamplingParams(temperature=1.5, top_k=20, top_p=0.6),
    SamplingParams(temperature=0.0),
]


def non_defaults(params: SamplingParams) -> str:
    default = SamplingParams()
    fields = ("temperature", "top_k", "top_p", "min_p")
    changed = [f"{f}={getattr(params, f)}" for f in fields if getattr(params, f) != getattr(default, f)]
    return ",".join(changed) or "greedy"


@pytest.mark.parametrize("params", FILTERS, ids=non_defaults)
def test_probs_match_plain_reference(params):
    logits = make_logits()
    probs = probs_from_logits(logits, params)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    expected = torch.tensor([reference_probs(row, params) for row in logits.tolist()], dtype=torch.float32)
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(logits)), atol=1e-5, rtol=0)
    # Whatever the filters, the most likely token survives.
    assert bool((probs.gather(-1, logits.argmax(-1, keepdim=True)) > 0).all())


def test_nucleus_stops_as_soon_as_its_mass_reaches_top_p():
    # Four equal tokens: exact quarters in fp32, so mass 0.75 is reached with three.
    probs = probs_from_logits(torch.zeros(1, 4), SamplingParams(temperature=1.0, top_p=0.75))
    assert (probs > 0).tolist() == [[True, True, True, False]]


def test_temperature_alone_is_scaled_softmax():
    logits = make_logits()
    torch.testing.assert_close(
        probs_from_logits(logits, SamplingParams(temperature=0.6)), torch.softmax(logits / 0.6, dim=-1)
    )


def test_low_precision_logits_give_fp32_probs():
    logits = make_logits().bfloat16()
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.9))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(logits)), atol=1e-5, rtol=0)


def test_greedy_is_argmax_lowest_index_on_ties_and_draws_nothing():
    logits = torch.cat([make_logits(), torch.tensor([[0.0, 5.0, 5.0, 1.0] + [-1.0] * 33])])
    g = make_generator(3)
    state = g.get_state()
    tokens = sample(logits, SamplingParams(temperature=0.0), [g] * len(logits))
    assert tokens.dtype == torch.long
    assert torch.equal(tokens, logits.argmax(-1))
    assert tokens[-1].item() == 1
    # Greedy spends no randomness, so a verifier and a plain decoder stay in step.
    assert torch.equal(g.get_state(), state)


def test_draws_match_probs_chi_square():
    logits = torch.tensor([[1.0, 0.5, -0.3, 2.0, 0.0, -4.0, 1.2]])
    params = SamplingParams(temperature=0.9, top_k=5)  # leaves two tokens at zero
    probs = probs_from_logits(logits, params)[0].double()
    n = 20_000
    g = make_generator(1234)
    tokens = sample(logits.expand(n, -1), params, [g] * n)
    counts = torch.bincount(tokens, minlength=logits.shape[1]).double()

    support = probs > 0
    assert support.sum() == 5
    assert counts[~support].sum() == 0
    expected = probs[support] * n
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    # Survival function of chi-square with dof degrees of freedom.
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2).item()
    assert p_value > 1e-3, (chi2.item(), counts.tolist(), expected.tolist())


def test_same_seed_same_tokens_whatever_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.95)
    mine = make_logits(rows=6, seed=1)
    others = make_logits(rows=6, seed=2)
    alone, batched = make_generator(99), make_generator(99)
    neighbours = [make_generator(s) for s in (5, 6, 7)]
    for step in range(6):
        solo = sample(mine[step : step + 1], params, [alone])
        batch = torch.stack([others[step], others[step + 6], mine[step], others[11 - step]])
        # Our sequence sits at row 2, after a neighbour that also draws.
        together = sample(batch, params, [neighbours[0], neighbours[1], batched, neighbours[2]])
        assert together[2].item() == solo.item()


def test_inverse_cdf_edges_never_pick_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0]] * 4)
    u = torch.tensor([0.0, 0.25 - 2**-24, 0.25, 1.0 - 2**-24])
    assert sample_from_probs(probs, u).tolist() == [1, 1, 3, 3]


def test_inverse_cdf_is_the_uniform_a_verifier_can_replay():
    logits = make_logits()
    params = SamplingParams(temperature=0.8, top_k=12)
    g1, g2 = make_generator(7), make_generator(7)
    drawn = sample(logits, params, [g1] * len(logits))
    replayed = sample_from_probs(probs_from_logits(logits, params), draw_uniforms([g2] * len(logits), len(logits)))
    assert torch.equal(drawn, replayed)


def test_generator_count_must_match_rows():
    with pytest.raises(ValueError, match="one generator per row"):
        sample(make_logits(rows=2), SamplingParams(temperature=1.0), [make_generator(0)])


def test_make_generator_is_reproducible_and_unseeded_streams_differ():
    assert torch.equal(torch.rand(4, generator=make_generator(11)), torch.rand(4, generator=make_generator(11)))
    assert not torch.equal(torch.rand(4, generator=make_generator(None)), torch.rand(4, generator=make_generator(None)))


def test_params_normalise_stop_lists_and_stay_hashable():
    p = SamplingParams(stop="\n", stop_token_ids=[2, 7])
    assert p.stop == ("\n",) and p.stop_token_ids == (2, 7)
    assert hash(p) == hash(SamplingParams(stop=["\n"], stop_token_ids=(2, 7)))


def test_validation_names_the_field():
    bad = [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_token_ids": (3, -1)}, "stop_token_ids"),
        ({"stop": ("",)}, "stop"),
        ({"stop": (None,)}, "stop"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ]
    for kwargs, field in bad:
        with pytest.raises(ValueError, match=f"^{field} "):
            SamplingParams(**kwargs)
