"""Prompt-lookup speculation through the engine: greedy output identical to
plain decoding, sampling with the target's distribution, rollback exact."""
import pytest
import torch

from engine import Engine
from model.sampler import SamplingParams, probs_from_logits
from tests.conftest import assert_all_pages_free
from tests.hf_models import make_hf_model

VOCAB = 320


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec")
    make_hf_model("qwen2-qkvbias", path, seed=3)
    return path


@pytest.fixture
def engine(ckpt):
    return Engine.from_pretrained(ckpt, page_size=8, num_pages=96)


def prompt_with_repeats(seed: int, n: int = 40) -> list[int]:
    """Random tokens with copied spans, so the drafter has something to find."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, VOCAB, (n,), generator=g).tolist()
    span = base[5:17]
    return base + span + base[20:30] + span[:6]


def check_consistent(s) -> None:
    # The newest generated token is held but not yet computed; nothing more.
    assert s.table.length == len(s) - 1
    assert len(s.table.pages) == -(-s.table.length // 8)


class StubDrafter:
    """Stands in for the n-gram drafter; keeps no history of its own."""

    draft_len = 6

    def __len__(self) -> int:
        return 0

    def extend(self, tokens) -> None:
        pass

    def truncate(self, n: int) -> None:
        pass

    def record(self, drafted: int, accepted: int) -> None:
        pass


class FixedDrafter(StubDrafter):
    """Always proposes the same tokens."""

    def __init__(self, draft: list[int]):
        self.draft, self.draft_len = draft, len(draft)

    def propose(self, k: int) -> list[int]:
        return self.draft[:k]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_k", [1, 3, 8])
def test_greedy_identical_with_and_without_speculation(engine, seed, max_k):
    prompt = prompt_with_repeats(seed)
    outs, stats = [], []
    for speculative in (False, True):
        with engine.session() as s:
            s.append(prompt)
            if speculative:
                s.drafter().max_k = max_k
            outs.append(s.generate(max_tokens=48, ignore_eos=True, speculative=speculative))
            stats.append(engine.stats[-1])
            check_consistent(s)
            assert s.tokens == prompt + outs[-1]
    assert outs[0] == outs[1]
    assert stats[0].drafted_tokens == 0
    assert stats[1].decode_steps <= stats[0].decode_steps


def test_speculation_accepts_and_rejects_and_saves_forwards(engine):
    drafted = accepted = steps_on = steps_off = 0
    for seed in range(6):
        prompt = prompt_with_repeats(seed)
        for speculative in (False, True):
            with engine.session() as s:
                s.append(prompt)
                s.generate(max_tokens=48, ignore_eos=True, speculative=speculative)
                st = engine.stats[-1]
                if speculative:
                    drafted, accepted, steps_on = drafted + st.drafted_tokens, accepted + st.accepted_tokens, steps_on + st.decode_steps
                else:
                    steps_off += st.decode_steps
    # Accepted drafts save forwards (random weights loop, so the n-gram
    # drafts are mostly right here; rejections are covered below).
    assert accepted > 0
    assert steps_on < steps_off


@pytest.mark.parametrize("seed", range(3))
def test_greedy_identical_under_partial_acceptance(engine, seed):
    prompt = prompt_with_repeats(seed)
    with engine.session() as s:
        s.append(prompt)
        truth = s.generate(max_tokens=40, ignore_eos=True, speculative=False)
    calls = [0]

    class Drafter(StubDrafter):
        def propose(self, k):
            calls[0] += 1
            done = len(s) - len(prompt)
            right = calls[0] % (k + 1)
            rest = truth[done : done + right]
            wrong = [(truth[done + right] + 1) % VOCAB] if done + right < len(truth) else []
            return (rest + wrong)[:k]

    with engine.session() as s:
        s.append(prompt)
        s.use_drafter(Drafter())
        out = s.generate(max_tokens=40, ignore_eos=True)
        st = engine.stats[-1]
        check_consistent(s)
    assert out == truth
    assert 0 < st.accepted_tokens < st.drafted_tokens


@pytest.mark.parametrize("seed", range(4))
def test_stop_inside_a_draft_leaks_nothing(engine, seed):
    prompt = prompt_with_repeats(seed)
    with engine.session() as s:
        s.append(prompt)
        free_run = s.generate(max_tokens=40, ignore_eos=True, speculative=False)
    for stop_at in (2, 9, 25):
        stop_token = free_run[stop_at]
        expected = free_run[: free_run.index(stop_token) + 1]
        for max_tokens in (40, 7):
            with engine.session() as s:
                s.append(prompt)
                out = s.generate(max_tokens=max_tokens, stop_token_ids=[stop_token], speculative=True)
                assert out == expected[:max_tokens]
                assert s.tokens == prompt + out
                check_consistent(s)
                # The KV kept is exactly that of the emitted tokens.
                more = s.append([7, 8, 9], all_logits=True)
            with engine.session() as ref:
                torch.testing.assert_close(more, ref.append(prompt + out + [7, 8, 9], all_logits=True)[-3:], atol=1e-5, rtol=0)


def test_sampling_with_speculation_has_the_target_distribution(engine):
    """Joint law of the first two sampled tokens, with a fixed draft at the
    second position that is sometimes accepted: chi-square against the exact
    law computed from the model's own logits."""
    prompt = prompt_with_repeats(11, 20)
    params = SamplingParams(temperature=1.0, top_k=3)
    with engine.session() as s:
        p1 = probs_from_logits(s.append(prompt)[None], params)[0]
        support1 = p1.nonzero().flatten().tolist()
        exact, p2_of = {}, {}
        for t1 in support1:
            with s.fork() as f:
                p2_of[t1] = probs_from_logits(f.append([t1])[None], params)[0]
            for t2 in p2_of[t1].nonzero().flatten().tolist():
                exact[(t1, t2)] = float(p1[t1] * p2_of[t1][t2])
    # Draft the second most likely second token after the most likely first.
    top1 = max(support1, key=lambda t: float(p1[t]))
    draft = [int(p2_of[top1].argsort(descending=True)[1]), 0]
    counts = dict.fromkeys(exact, 0)
    trials, accepted = 600, 0
    for seed in range(trials):
        with engine.session() as s:
            s.append(prompt)
            s.use_drafter(FixedDrafter(draft))
            out = s.generate(max_tokens=3, temperature=1.0, top_k=3, seed=seed, ignore_eos=True)
            accepted += engine.stats[-1].accepted_tokens
            counts[tuple(out[:2])] += 1
    assert 0 < accepted < trials
    chi2 = sum((counts[c] - trials * p) ** 2 / (trials * p) for c, p in exact.items())
    # 8 degrees of freedom at most; 26.1 is the 0.999 quantile.
    assert chi2 < 26.1, (chi2, counts, exact)


def test_page_accounting_after_rejections(engine):
    with engine.session() as s:
        s.append(prompt_with_repeats(3))
        s.use_drafter(FixedDrafter([1, 2, 3, 4, 5, 6, 7]))  # almost always rejected: rollback every step
        s.generate(max_tokens=30, ignore_eos=True)
        check_consistent(s)
        engine.pool.check()
    assert_all_pages_free(engine)
